"""Everything that imports verl (and, where present, vLLM / SGLang): thin adapters into verl's registries."""
