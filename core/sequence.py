"""What a sequence's length must be a multiple of for the mesh to split it (no torch here: option checks use it)."""
import math


def sequence_multiple(cp: int, sequence_parallel_tp: int = 1) -> int:
    """2 x cp equal chunks under context parallelism (two per cp rank: layers.context_parallel.zigzag_index), and each
    cp rank's share (length / cp) split over tp under sequence parallelism (layers.batch.BatchContext.shard_sequence)."""
    return math.lcm(2 * cp if cp > 1 else 1, cp * sequence_parallel_tp)
