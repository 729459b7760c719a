"""The run's services: checkpoints, metrics, paths, sharding, processes, host memory."""
