"""The benches' playback replay (`bench.workload.play`), and the duel's pcm16 byte counting, per-round
figures and stage config (`bench.omni_duel`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from voicewire.adapters.omni import CPU_STAGE_CONFIGS

from bench.omni_duel import PREFIX_GRAPH_SEQ_LENS, expected_audio_s, figures, measure, pcm_samples, write_deploy_config
from bench.workload import play


def test_a_stream_that_stays_ahead_of_playback_never_stalls() -> None:
    # 0.1 s at 1000 Hz arrives at t=1.0; the next 0.2 s arrives at 1.05, before the first piece ends.
    stream = play(0.9, [(1.0, 100), (1.05, 200), (1.2, 100)], 1000)
    assert stream.ttfa_ms == pytest.approx(100.0)
    assert stream.stalls == 0
    assert stream.stall_s == 0.0
    assert stream.audio_s == pytest.approx(0.4)


def test_a_late_piece_is_a_stall_of_its_lateness_and_playback_resumes_from_it() -> None:
    # The first 0.1 s ends at 1.1; the second arrives at 1.3 (0.2 s late) and plays until 1.4; the third
    # arrives at 1.35, in time.
    stream = play(1.0, [(1.0, 100), (1.3, 100), (1.35, 100)], 1000)
    assert stream.stalls == 1
    assert stream.stall_s == pytest.approx(0.2)
    assert stream.stall_chunks == (1,)
    assert stream.rtf == pytest.approx(0.35 / 0.3)


def test_pcm16_pieces_that_split_a_sample_count_it_once_where_it_completes() -> None:
    assert pcm_samples([(1.0, 3), (2.0, 1), (3.0, 1), (4.0, 4)]) == [(1.0, 1), (2.0, 1), (4.0, 2)]
    assert sum(n for _, n in pcm_samples([(0.0, 1)] * 9)) == 4


def test_the_duel_counts_each_stream_up_to_its_length_and_lists_short_and_long_ones() -> None:
    """A pipeline that sends a stream's audio twice must not look faster: throughput counts each stream up to
    its frames' audio, and streams more than a frame off it are listed as short or long."""
    expected = expected_audio_s(150)
    assert expected == pytest.approx(11.92)
    wall = 2.0
    audio = [expected, expected, 2 * expected - 0.9, 3.0, expected - 0.05]
    got = figures([{"ttfa_ms": [50.0] * 5, "stall_s": [0.0] * 5, "stalls": [0] * 5, "audio_s": audio,
                    "audio_s_per_wall_s": sum(audio) / wall, "errors": []}], expected)
    assert got["short"] == [1] and got["long"] == [1]
    assert got["audio_s_per_wall_s"][0] == pytest.approx((4 * expected - 0.05 + 3.0) / wall)


def test_the_duel_says_at_which_piece_its_streams_stalled() -> None:
    """Measured from real arrivals: a stream whose second piece came late and one whose ninth did."""
    rate = 24000
    second_late = [(0.00, 1920), (0.20, 1920), (0.21, 48000)]
    ninth_late = [(0.00, 48000), *[(0.01 * i, 1920) for i in range(1, 8)], (5.0, 1920)]
    got = measure([(-0.05, [(at, 2 * n) for at, n in arrivals], None) for arrivals in (second_late, ninth_late)],
                  rate)
    assert got["stall_chunks"] == [[1], [8]]
    assert got["timelines"][0] == [[50, 80], [250, 80], [260, 2000]]
    assert figures([got], 2.16)["stalls_at"] == "#2: 1, later: 1"


def test_the_duels_stage_config_changes_the_talker_only_where_asked(tmp_path: Path) -> None:
    base = CPU_STAGE_CONFIGS["qwen3_tts"]
    given = yaml.safe_load(base.read_text())
    plain = yaml.safe_load(write_deploy_config(base, tmp_path / "plain.yaml", max_num_seqs=64, gpu_share=None,
                                               kv_cache_gib=None).read_text())
    assert plain["connectors"] == given["connectors"]
    assert [s["max_num_batched_tokens"] for s in plain["stages"]] == [s["max_num_batched_tokens"]
                                                                      for s in given["stages"]]
    assert all(s["load_format"] == "dummy" and s["max_num_seqs"] == 64 for s in plain["stages"])
    tuned = yaml.safe_load(write_deploy_config(base, tmp_path / "tuned.yaml", max_num_seqs=64, gpu_share=None,
                                               kv_cache_gib=None, talker_step_tokens=512,
                                               prefix_graph_batches=[64]).read_text())
    talker, code2wav = tuned["stages"]
    assert talker["max_num_batched_tokens"] == 512
    assert code2wav["max_num_batched_tokens"] == given["stages"][1]["max_num_batched_tokens"]
    [connector] = tuned["connectors"].values()
    assert connector["extra"] == {**given["connectors"]["connector_of_shared_memory"]["extra"],
                                  "code_predictor_prefix_graphs": True, "code_predictor_prefix_graph_buckets": [64],
                                  "code_predictor_prefix_graph_seq_lens": list(PREFIX_GRAPH_SEQ_LENS)}
