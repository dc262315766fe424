"""The Ray backend: a driver's stop told to its training actors, a lost actor's group turned
into the policy's evidence, recreated and resumed. Users import ``kempner_resilience.ray``."""
