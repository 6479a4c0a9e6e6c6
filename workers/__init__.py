"""Workers: the floor (configs, errors) and the rooms below it: models, runtime, speculation, service, training."""
