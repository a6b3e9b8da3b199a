"""The training recipe: config, data, models, checkpoints, metrics, failure handling, and the two roles."""
