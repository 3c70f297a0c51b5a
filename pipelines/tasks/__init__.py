"""The tasks, one file each: what a request kind changes in the one program
(:class:`pipelines.runner.Task`). Text-to-image is the base task itself
(:data:`pipelines.runner.TEXT`)."""
