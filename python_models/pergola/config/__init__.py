"""Settings: the options machinery, the per-model engine config, model folders and Hub ids."""
