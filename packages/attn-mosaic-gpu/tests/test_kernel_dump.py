"""``benchmarks/kernel_dump.py --loops`` off a GPU: the SASS loop counter finds the step
loops (a backward branch to an earlier label, holding HGMMAs) and counts their spills."""

from __future__ import annotations

from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "kernel_dump.py"

SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   LDL R8, [R1+0x8]                      (*"SpillRefill"*);
        /*0030*/                   MUFU.EX2 R9, R8 ;
        /*0040*/                   STL [R1+0x8], R9                      (*"SpillRefill"*);
        /*0050*/              @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R2 ;
        /*0070*/              @!P1 BRA `(.L_x_2) ;
.L_x_3:
        /*0080*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0090*/                   FMUL R3, R3, R4 ;
        /*00a0*/              @P2 BRA `(.L_x_3) ;
        /*00b0*/                   EXIT ;
"""


def test_sass_loops_counts_each_step_loop():
    with load_script(SCRIPT, "kernel_dump") as dump:
        loops = dump.sass_loops(SASS)
    # the barrier's retry loop holds no HGMMA and is not a step loop
    assert [(x["HGMMA"], x["STL"], x["LDL"], x["MUFU"]) for x in loops] == [
        (1, 1, 1, 1),
        (1, 0, 0, 0),
    ]
    assert [x["instructions"] for x in loops] == [5, 3]
