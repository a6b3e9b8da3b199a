"""A run from start to end: preflight, the world, each role's set-up and loop (`run`, `student_trainer`,
`cache_writer`), and what a run shows when done (`run_report`, `plot`, `completions`)."""
