"""What a sequence's length must be a multiple of for the mesh to split it (no torch here: option checks use it)."""
import math

# why a length must be such a multiple, for the messages that refuse one
SPLIT_REASON = ("context parallelism cuts a sequence into 2 x cp equal chunks, sequence parallelism each cp rank's "
                "share over tp")


def sequence_multiple(cp: int, sequence_parallel_tp: int = 1) -> int:
    """2 x cp equal chunks under context parallelism (two per cp rank: layers.context_parallel.zigzag_index), and each
    cp rank's share (length / cp) split over tp under sequence parallelism (layers.batch.BatchContext.shard_sequence)."""
    return math.lcm(2 * cp if cp > 1 else 1, cp * sequence_parallel_tp)
