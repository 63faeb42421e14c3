"""Typed answers from model APIs (issue 51), in pure pieces (no Spark, no network, no
clock): the :class:`~.spec.Answer` option, its schema as JSON Schema and the check of a
value against it (:mod:`.shape`), and each API's way to ask for it and to give it back
(:mod:`.apis`). The HTTP target asks with it and checks every answer; the output's
``reply`` column is read from the answers that fit.
"""
