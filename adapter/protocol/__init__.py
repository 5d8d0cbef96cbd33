"""Request validation and body models of the MindIE endpoints (``/v1/completions``, ``/infer``)."""
