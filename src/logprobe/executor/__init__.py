"""Who runs the engine: the processes that own parallel workers (``workers``) and the engine that
drives them from the caller's process (``engine``). The collectives themselves live in ``parallel``."""
