"""Rows sent once and answers kept: :mod:`.journal` (what a run has answered, for
``--resume``), :mod:`.stream_record` (a stream's record of what each micro-batch sent)
and :mod:`.dedupe` (identical requests sent once)."""
