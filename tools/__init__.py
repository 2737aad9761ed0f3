"""Tools for the project's developers, not installed with moerun: training the demo model
(`tools/train`), run from the repository root as `python -m tools.train.<module>`."""
