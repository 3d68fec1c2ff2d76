"""tests/sanitize_gpu.py's reading of compute-sanitizer logs (the tools themselves need the GPU)."""
from pathlib import Path

import sanitize_gpu

RACE_LOG = Path(__file__).resolve().parents[2] / "benchmarks/plots/2026-12-02-a/racecheck_attention_before_call7.log"


def _known_log() -> str:
    """A recorded racecheck log of the attention backward's raw byte copies (4 reports, 32 errors by the tool's
    count), with the copy under the name it has in the tile library now."""
    return RACE_LOG.read_text().replace(
        "tk_attn::bulk_load_1d(void *, const void *, unsigned int, unsigned long *)",
        "tk::tma::load_bytes_async(void *, const void *, unsigned int, tk::semaphore &)")


def test_memcheck_counts_every_error():
    assert sanitize_gpu.summary("memcheck", "========= ERROR SUMMARY: 3 errors\n")[0] == 3
    assert sanitize_gpu.summary("memcheck", "no summary")[0] == -1


def test_racecheck_reports_on_the_byte_copies_are_known():
    errors, line = sanitize_gpu.summary("racecheck", _known_log())
    assert errors == 0 and "4 reports, 4 of them known" in line


def test_racecheck_counts_any_other_race():
    other = ("========= Error: Race reported between Write access at tk_attn::store_ds<64, 0>(unsigned int)+0x10 in "
             "backward.cuh:230\n=========     and Read access at foo+0x20 in backward.cuh:300 [4 hazards]\n")
    log = _known_log() + other
    assert sanitize_gpu.summary("racecheck", log)[0] == 1
    # before the copies were renamed nothing is known: every report counts
    assert sanitize_gpu.summary("racecheck", RACE_LOG.read_text())[0] == 4


def test_racecheck_read_first_reports_on_the_byte_copies_are_known():
    copy = "tk::tma::load_bytes_async(void *, const void *, unsigned int, tk::semaphore &)"
    read_first = (f"========= Error: Race reported between Read access at tk_ssd::chunk_decays(const float *, float)+0x1f00"
                  f" in ssd.cuh:153\n=========     and Write access at {copy}+0xb800 in tma.cuh:23 [496 hazards]\n"
                  f"=========     and Write access at {copy}+0xbb40 in tma.cuh:23 [496 hazards]\n")
    assert sanitize_gpu.summary("racecheck", _known_log() + read_first)[0] == 0
    # a read racing with any other write is not known, whichever access the report names first
    other = read_first.replace(f"{copy}+0xbb40", "tk_ssd::store_state(float *)+0x40")
    assert sanitize_gpu.summary("racecheck", _known_log() + other)[0] == 1


def test_racecheck_reports_inside_cublas_are_counted_apart():
    """cuBLAS's sm_90 GEMMs (the Hedgehog weight gradient's matmul) run pipelines racecheck does not follow: a report
    whose writes are all inside them is not ours; one in our kernel beside them still counts."""
    cublas = ("========= Error: Race reported between Read access at nvjet_sm90_tst_64x64_64x13_1x1_h_bz_NTT+0xa70\n"
              "=========     and Write access at nvjet_sm90_tst_64x64_64x13_1x1_h_bz_NTT+0x2c40 [4 hazards]\n")
    errors, line = sanitize_gpu.summary("racecheck", _known_log() + cublas)
    assert errors == 0 and "5 reports, 5 of them known" in line
    ours = cublas.replace("Write access at nvjet_sm90_tst_64x64_64x13_1x1_h_bz_NTT",
                          "Write access at tk_linear_attention::hedgehog_map_bwd_kernel")
    assert sanitize_gpu.summary("racecheck", _known_log() + ours)[0] == 1
