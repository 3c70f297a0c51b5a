"""The HTTP service on a real Ray Serve over real HTTP (one local Ray cluster for the package:
``conftest.py``). A package, not a folder of modules, so its fixtures live as long as the package
runs; not named ``serving``, which would shadow the service's own package (``tests/`` is on
``sys.path``)."""
