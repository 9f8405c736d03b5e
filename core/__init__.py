"""The ground floor every other part imports: the mesh and its process groups, the RNG of model
parallelism, the pipeline partition of layers, dtype names."""
