"""Training the embedded demo model: procedural data (``shapes``), the JAX training loop
(``train``) and export to a diffusers folder (``export``). Its prompt-fidelity evaluation runs
the pipeline, so it lives a layer up, in ``pipelines.demo_eval``."""
