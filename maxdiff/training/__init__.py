"""Training the embedded demo model: procedural data (``shapes``), the JAX training loop
(``train``), export to a diffusers folder (``export``) and the prompt-fidelity check
(``evaluate``)."""
