"""Tensor parallelism: ranks launched and watched (``ranks``), and rank 0's steps mirrored to the
followers (``step_channel``)."""
