"""The benchmark harnesses. Each runs from the repository root as `python -m benchmarks.<harness>` (README.md),
which puts the root on the path: `benchmarks.common` and the main job's `parallel` import as packages."""
