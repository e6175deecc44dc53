"""Engine statistics: per-request timestamps turned into latencies and token counts
(``stats``), reported by stat loggers: a periodic log line (``loggers``) and
Prometheus metrics (``prometheus``).

``AsyncLLM`` builds one ``IterationStats`` per engine step on the event loop and
hands it, with the step's ``SchedulerStats``, to every registered ``StatLogger``.
"""
