"""The tiling follows the Neuron kernel's setup_config rules."""

from __future__ import annotations

import math

import pytest

from numbafa.conventions import tiling


@pytest.mark.parametrize("d_head,d_tile,n_tiles,section", [
    (64, 64, 1, 8192), (96, 96, 1, 8192), (128, 128, 1, 8192), (200, 100, 2, 4096),
    (256, 128, 2, 4096), (384, 128, 3, 2048), (512, 128, 4, 2048), (1024, 128, 8, 1024)])
def test_setup_config_head_dim_tiling(d_head, d_tile, n_tiles, section):
    cfg = tiling.setup_config(4096, 4096, d_head)
    assert (cfg.d_tile, math.ceil(d_head / cfg.d_tile), cfg.section_len) == (d_tile, n_tiles, section)


@pytest.mark.parametrize("d_head,d_head_v,d_tile,section", [
    (192, 128, 128, 4096), (128, 192, 96, 4096), (64, 256, 128, 4096), (256, 64, 64, 4096), (32, 160, 80, 4096),
    (96, 64, 64, 8192)])
def test_value_head_dim_sets_the_rowsum_tile_and_the_wider_dim_the_section(d_head, d_head_v, d_tile, section):
    """D = rowsum(dO * O) runs over d_head_v; a section holds K/dK (d_head) and V/dV (d_head_v)."""
    cfg = tiling.setup_config(4096, 4096, d_head, d_head_v)
    assert (cfg.d_tile, cfg.section_len) == (d_tile, section)
    assert tiling.setup_config(4096, 4096, d_head, d_head) == tiling.setup_config(4096, 4096, d_head)
    with pytest.raises(ValueError, match="d_head_v should be >= 1, got 0"):
        tiling.setup_config(1, 1, 64, 0)


def test_setup_config_small_and_ragged():
    cfg = tiling.setup_config(97, 300, 64)
    assert cfg.k_tile == 300 and math.ceil(97 / cfg.q_tile) == 1 and math.ceil(300 / cfg.section_len) == 1
    assert math.ceil(9000 / tiling.setup_config(1025, 9000, 64).section_len) == 2
    with pytest.raises(ValueError, match="seqlen_k should be >= 1, got 0"):
        tiling.setup_config(1, 0, 64)


def test_power_of_2():
    assert [tiling.power_of_2(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
