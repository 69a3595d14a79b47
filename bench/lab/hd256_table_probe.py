"""A/B probe: head_dim 256 with the measured table for layouts and tile widths ("both"), for
layouts only ("layouts"), or not at all ("none").  usage: hd256_table_probe.py MODE TABLE devset-args"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pat_core import cuda_compile as cc, tiles
mode, table = sys.argv.pop(1), Path(sys.argv.pop(1))
real = cc.variant_speed_path
cc.variant_speed_path = lambda head_dim=128: (table if mode != "none" else Path("/nonexistent")) \
    if head_dim == 256 else real(head_dim)
cc.variant_speed.cache_clear()
if mode == "layouts":
    orig = tiles.TileSelector.measured_speed
    tiles.TileSelector.measured_speed = lambda self, m, n: None if self.head_dim == 256 \
        else orig(self, m, n)
import devset
sys.exit(devset.main(sys.argv[1:]))
