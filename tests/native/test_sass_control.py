"""scripts/sass_control.py reads which SASS instruction waits for which memory operation from the
control bits. Checked on instructions nvcc and Triton emitted for sm_90 (cuobjdump's text, as
kernel_ptx.py and native_kernel_sass.py read it): each result's first reader waits on the
scoreboard its producer set."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import sass_control  # noqa: E402

# From the Triton capture kernel before the thirteenth session (bf16 hc mean, Triton 3.9): a
# register load and the compare that reads R2; the claim's atomic and the store of its result R6.
SASS = """
        /*0060*/                   LDG.E R2, desc[UR12][R2.64] ;                                   /* 0x0000000c02027981 */
                                                                                                   /* 0x001eee000c1e1900 */
        /*0190*/                   ISETP.NE.U32.AND P0, PT, R2, RZ, PT ;                           /* 0x000000ff0200720c */
                                                                                                   /* 0x008fe40003f05070 */
        /*06f0*/                   ATOMG.E.ADD.STRONG.GPU PT, R6, desc[UR12][R2.64], R7 ;          /* 0x00000007020679a8 */
                                                                                                   /* 0x00016400081ee1cc */
        /*0710*/               @P3 STS [UR6], R6 ;                                                 /* 0x00000006ff003988 */
                                                                                                   /* 0x020fe20008000806 */
"""


def test_each_result_is_awaited_on_the_scoreboard_its_producer_set():
    load, compare, atomic, store = sass_control.parse(SASS)
    assert (load.address, atomic.address) == (0x60, 0x6F0) and store.text.startswith("@P3 STS")
    assert load.sets == 3 and compare.waits == {3}
    assert atomic.sets == 5 and store.waits == {5}
    assert compare.sets is None and store.sets is None


def test_in_flight_through_the_atomic_unless_something_waits_for_it():
    code = sass_control.parse(SASS)
    # The register load's scoreboard is waited on (by the compare) before the atomic issues.
    assert sass_control.in_flight_through(code, r"^LDG", r"ATOMG") is False
    # Without the compare, nothing waits for it before the atomic.
    assert sass_control.in_flight_through([code[0], code[2], code[3]], r"^LDG", r"ATOMG") is True
    # The atomic before the load, or a load that is not there: no answer.
    assert sass_control.in_flight_through(code, r"STS", r"ATOMG") is None
    assert sass_control.in_flight_through(code, r"LDG\.E\.128", r"ATOMG") is None
