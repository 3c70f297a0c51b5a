"""The shipped YAML configs (run configs, the service's, training's). Installed as the package
``maxdiff.configs`` so that ``maxdiff.config`` finds them through importlib.resources."""
