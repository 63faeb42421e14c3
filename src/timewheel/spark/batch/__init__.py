"""Many rows per request, in pure pieces (no Spark, no network, no clock of their own):
:mod:`.spec`, :mod:`.accumulator`, :mod:`.isolation`, :mod:`.run`, :mod:`.replies`."""
