"""megatron-core on a CPU build of torch: the runtime's fixes (:mod:`.runtime`) and the local attention / weight bridge
adapters of the CPU Megatron engine."""
