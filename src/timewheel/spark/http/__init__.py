"""The HTTP target: :class:`~timewheel.spark.http.target.HttpDownstream` builds each
row's request (:mod:`.request`) and sends it on one libcurl loop per Python worker
(:mod:`._curl`). Users import it from :mod:`timewheel.spark.targets`."""
