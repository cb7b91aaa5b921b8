"""``kind = "auto"`` without processes: the decision rule, the wire fit, the falling budget and
the probe cadence on hand-made figures, and the schedule keys (checked, with clear errors).
The measurement on real ranks is ``tests/test_autotune_probe.py``, whole runs
``tests/test_autotune_run.py``."""
import copy
import io
import math

import pytest
import torch

from hpcgnn.autotune import (DIRECTIONS, MAX_BACKOFF, AutoPolicy, AutoSettings, AutoState,
                             ExchangeFigures, Figures, _probe_interval, choose, decide, fit_wire,
                             next_budget, prior_error, prior_figures, signature, start,
                             verify_steps)
from hpcgnn.codecs.quant import decode_values, encode_values
from hpcgnn.codecs import IDENTITY, WireCodec
from hpcgnn.schedule import ScheduleError, load_schedule

# relative errors 1.5, 0.15, 0.006, 2e-5; bytes of 1000 rows x 64 channels; codec seconds
FIG = ExchangeFigures(norm2=100.0, error2={1: 150.0, 2: 15.0, 4: 0.6, 8: 0.002},
                      codec_s={1: 0.004, 2: 0.004, 4: 0.005, 8: 0.006},
                      bytes={1: 14000, 2: 22000, 4: 38000, 8: 70000, 32: 256000})
BITS = (1, 2, 4, 8)


def test_relative_error_is_error2_over_norm2():
    assert FIG.error(2) == pytest.approx(0.15) and FIG.error(32) == 0.0
    assert ExchangeFigures(0.0, {2: 0.0}, {}, {}).error(2) == 0.0   # nothing sent: no error


@pytest.mark.parametrize("budget,beta,want", [
    (math.inf, 1e-6, 1),       # slow link, anything goes: fewest bytes
    (0.2, 1e-6, 2),            # 1 bit (1.5) over budget
    (0.01, 1e-6, 4),
    (1e-4, 1e-6, 8),
    (1e-6, 1e-6, 32),          # nothing but fp32 within budget
    (math.inf, 1e-9, 32),      # 0.256 ms of fp32 wire beats 4+ ms of codec: fp32 wins on time
    (math.inf, 5e-8, 1),       # 0.7 ms of wire for 1 bit against 12.8 ms for fp32
    (0.15, 1e-6, 2),           # "within" includes the budget itself
])
def test_choose_least_cost_within_budget(budget, beta, want):
    # costs at beta: 32 -> 256000 beta; b -> codec_s[b] + bytes[b] beta (alpha cancels)
    assert choose(FIG, BITS, budget, (0.001, beta)) == want


def test_choose_ties_go_to_the_more_precise_and_bytes_objective_ignores_time():
    even = ExchangeFigures(1.0, {b: 0.0 for b in BITS}, {b: 0.0 for b in BITS},
                           {b: 10.0 for b in (*BITS, 32)})
    assert choose(even, BITS, 1.0, (0.0, 1.0)) == 32
    assert choose(FIG, BITS, 0.2, (0.0, 1e-12), objective="bytes") == 2   # time would say fp32


def test_the_setting_in_use_stays_within_the_hysteresis_and_while_allowed():
    # beta 5e-8: costs 1 -> 4.7 ms, 2 -> 5.1 ms (+9 %), 4 -> 6.9 ms (+47 %), fp32 12.8 ms
    wire = (0.0, 5e-8)
    assert choose(FIG, BITS, math.inf, wire) == 1
    assert choose(FIG, BITS, math.inf, wire, current=2) == 2       # 9 % dearer: stays
    assert choose(FIG, BITS, math.inf, wire, current=4) == 1       # 47 % dearer: moves
    assert choose(FIG, BITS, 0.01, wire, current=2) == 4           # 2 bits over budget: moves
    assert choose(FIG, BITS, math.inf, wire, "bytes", current=2) == 1   # bytes: no hysteresis


def test_fp32_wins_a_near_tie_before_the_setting_in_use():
    # beta 1.75e-8: 1 bit 4.25 ms, 2 bits 4.39 ms, fp32 4.48 ms (5 % dearer than 1 bit):
    # compression would pay too little to risk its convergence cost, so fp32
    wire = (0.0, 1.75e-8)
    assert choose(FIG, BITS, math.inf, wire) == 32
    assert choose(FIG, BITS, math.inf, wire, current=2) == 32
    # beta 2.5e-8: fp32 6.4 ms against 4.35 for 1 bit (47 % dearer): compression pays
    assert choose(FIG, BITS, math.inf, (0.0, 2.5e-8)) == 1


def test_overlapped_wire_time_is_free_up_to_the_layers_compute():
    hidden = ExchangeFigures(FIG.norm2, FIG.error2, FIG.codec_s, FIG.bytes, compute_s=0.3,
                             overlap=True)
    assert choose(FIG, BITS, math.inf, (0.0, 1e-6)) == 1          # blocking: bytes cost time
    assert choose(hidden, BITS, math.inf, (0.0, 1e-6)) == 32      # 0.256 s of fp32 wire hidden
    shorter = ExchangeFigures(FIG.norm2, FIG.error2, FIG.codec_s, FIG.bytes, compute_s=0.1,
                              overlap=True)
    # 0.156 s of fp32 wire exposed; 1 and 2 bits fully hidden at the same codec cost: 2 bits
    assert choose(shorter, BITS, math.inf, (0.0, 1e-6)) == 2


def test_fit_wire_least_squares_free_bytes_and_the_ratio_fallback():
    alpha, beta = fit_wire([(1000.0, 0.003), (3000.0, 0.007), (2000.0, 0.005)])
    assert alpha == pytest.approx(0.001) and beta == pytest.approx(2e-6)
    assert fit_wire([(1000.0, 0.002), (1000.0, 0.004)]) == pytest.approx((0.0, 3e-6))  # one size
    # no cost per byte visible (beta <= 0): bytes are free, the mean is latency — not the
    # ratio, which would charge 2 us per byte of a link the samples say is faster than that
    assert fit_wire([(1000.0, 0.004), (2000.0, 0.002)]) == pytest.approx((0.003, 0.0))
    assert fit_wire([]) == (0.0, 0.0)


def test_fit_wire_never_gives_a_negative_latency():
    """Small messages timed far below the line through the large ones: the free fit's intercept
    is -3 ms, so a 1 kB message would take negative time and a fp32/compressed cost ratio
    could be infinite or negative. The fit is then the least-squares line through the origin
    (the best with ``alpha >= 0``): checked against a brute-force search over slopes."""
    samples = [(1000.0, 1e-4), (2000.0, 1e-4), (100000.0, 0.3)]
    alpha, beta = fit_wire(samples)
    assert alpha == 0.0
    sse = lambda b: sum((s - b * x) ** 2 for x, s in samples)      # noqa: E731
    grid = [2.5e-6 + i * 1e-9 for i in range(1001)]
    assert sse(beta) <= min(sse(b) for b in grid) + 1e-15
    assert all(alpha + beta * x > 0 for x, _ in samples)


def test_budget_is_the_share_of_the_fastest_improvement_and_never_rises():
    """``g``: the loss's relative fall per window, averaged over up to four windows back;
    the budget ``min(B, g / max g)``."""
    assert next_budget(1.0, [], [2.0]) == (1.0, 0.0)                  # nothing to compare yet
    # g = 1 - 1.8 / 2.0 = 0.1, the fastest yet: the whole budget
    assert next_budget(1.0, [2.0], [1.9, 1.7]) == pytest.approx((1.0, 0.1))
    # four windows back at most: g = (1 - 1.0 / 1.8) / 4 = 1/9, against 0.2 before: 5/9
    assert next_budget(1.0, [2.0, 1.8, 1.6, 1.5, 1.2], [1.0], 0.2) == pytest.approx((5 / 9, 0.2))
    # a faster fall than any before raises the peak, never the budget
    assert next_budget(0.3, [2.0], [1.0], 0.2) == pytest.approx((0.3, 0.5))
    assert next_budget(0.5, [1.0], [1.1], 0.2) == (0.0, 0.2)             # the loss got worse
    assert next_budget(1.0, [1.0], [1.0]) == (0.0, 0.0)                 # it never fell
    # one window worse than the last does not end compression: g = (1 - 0.75 / 1.0) / 4
    assert next_budget(1.0, [1.0, 0.9, 0.8, 0.7], [0.75], 0.125) == pytest.approx((0.5, 0.125))


def _figures(scale: float = 1.0) -> Figures:
    fig = ExchangeFigures(FIG.norm2, {b: v * scale for b, v in FIG.error2.items()},
                          FIG.codec_s, FIG.bytes)
    return Figures({(0, "forward"): fig, (0, "backward"): fig},
                   {"forward": [(256000.0, 0.26), (70000.0, 0.075)], "backward": []})


def _run(losses, probe_at, settings=AutoSettings(objective="bytes"), figures=_figures):
    """Drive ``decide`` as the trainer does: checks every ``every`` epochs, figures at probes."""
    state, out = AutoState(), []
    for epoch, loss in enumerate(losses):
        probing = epoch % settings.every == 0 and epoch >= state.next_probe and not state.settled
        state.window.append(loss)
        if epoch % settings.every == 0:
            state, record = decide(state, settings, figures() if probing else None, epoch)
            probe_at.append(epoch) if probing else None
            out.append(record)
    return state, out


def test_decide_budget_falls_bits_rise_then_settle():
    means = [1.0, 0.9, 0.85, 0.84, 0.845, 0.85, 0.85, 0.9]      # per 5-epoch window
    losses = [2.0] + [m for m in means for _ in range(5)]
    probes = []
    state, records = _run(losses, probes)
    budgets = [r["budget"] for r in records]
    bits = [r["exchanges"][0]["bits"] for r in records]
    # g per check: 0.5 (the fastest), 0.275, 0.575 / 3, 0.145, 0.03875, 0.05 / 3.6, 0, < 0
    assert budgets == pytest.approx([1.0, 1.0, 0.55, 0.575 / 1.5, 0.29, 0.0775, 0.1 / 3.6,
                                     0.0, 0.0])
    assert [r["peak"] for r in records] == pytest.approx([0.0] + [0.5] * 8)   # recorded
    assert bits == [2, 2, 2, 2, 2, 4, 4, 32, 32]     # fewest bytes within each budget (1 bit's
    #                                                  error 1.5 is over B_0 = 1)
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    # probes 5 apart, then the interval doubles while a probe changes nothing (the move to 4
    # bits at epoch 25 came from the budget, between probes); none once settled
    assert probes == [0, 5, 15, 35] and state.settled
    assert [r["probed"] for r in records] == [e in probes for e in range(0, 45, 5)]
    assert records[-1]["next_probe"] is None


def test_probe_interval_doubles_while_nothing_changes():
    losses = [2.0 * 0.9 ** t for t in range(200)]    # steady 0.41 improvement per window
    probes = []
    _run(losses, probes, AutoSettings(objective="bytes", every=5))
    assert probes[:6] == [0, 5, 15, 35, 75, 115]       # the budget 1 -> 0.21: 2 bits throughout
    assert max(b - a for a, b in zip(probes, probes[1:])) == MAX_BACKOFF * 5
    held = AutoState(bits={"0/forward": 2}, interval=20, probes=3)
    assert _probe_interval(held, {"0/forward": 2}, 5) == 40      # unchanged: doubles
    assert _probe_interval(held, {"0/forward": 4}, 5) == 5       # changed: back to every


def test_a_decision_the_budget_changes_is_not_a_probes_news():
    """A probe whose measurements decide as the figures before it would have at the same
    budget changed nothing, even where the falling budget moves the bits at that check: the
    interval doubles. Measurements that decide otherwise reset it."""
    fig = {"0/forward": FIG.to_dict(), "0/backward": FIG.to_dict()}
    # the last window improved the loss by 0.05 against a peak of 0.5: budget 1 -> 0.1, under
    # 2 bits' error (0.15), over 4 bits' (0.006)
    held = AutoState(bits={"0/forward": 2, "0/backward": 2}, budget=1.0, peak=0.5,
                     window=[0.95] * 5, means=[1.0], measured=fig,
                     wire={"forward": [[256000.0, 0.26], [70000.0, 0.075]], "backward": []},
                     interval=10, next_probe=15, probes=2)
    settings = AutoSettings(objective="bytes")
    same, _ = decide(copy.deepcopy(held), settings, _figures(), 15)
    assert same.budget == pytest.approx(0.1)
    assert same.bits == {"0/forward": 4, "0/backward": 4}       # moved by the budget
    assert (same.interval, same.next_probe) == (20, 35)         # not news: doubles
    news, _ = decide(copy.deepcopy(held), settings, _figures(scale=0.5), 15)
    assert news.bits == {"0/forward": 2, "0/backward": 2}       # 2 bits now measure 0.075
    assert (news.interval, news.next_probe) == (5, 20)          # news: back to every


@pytest.mark.parametrize("codec_s,want", [
    # the link's 1 ms a exchange plus 1 ns a byte: fp32 costs 1.256 ms; every candidate's codec
    # (4-6 ms) more than that: fp32 is predicted cheaper outright, so the second probe that
    # finds it so goes to the longest interval at once (5 + 8 x 5 = 45)
    (1.0, [0, 5, 45, 85]),
    # codecs 20x faster (0.2-0.3 ms): 2 bits 1.222 ms, under fp32's 1.256 but within the 10 %
    # tie that fp32 wins: fp32 is sent, but not clearly cheaper, so the interval only doubles
    (0.05, [0, 5, 15, 35, 75]),
])
def test_probes_back_off_at_once_where_fp32_is_clearly_cheaper(codec_s, want):
    fig = ExchangeFigures(FIG.norm2, FIG.error2, {b: v * codec_s for b, v in FIG.codec_s.items()},
                          FIG.bytes)
    link = [(256000.0, 0.001256), (70000.0, 0.00107)]            # 1 ms + 1 ns a byte
    figures = lambda: Figures({(0, "forward"): fig, (0, "backward"): fig},  # noqa: E731
                              {"forward": link, "backward": link})
    losses = [2.0 * 0.9 ** t for t in range(100)]   # steady: the budget stays above 2 bits'
    probes = []
    state, records = _run(losses, probes, AutoSettings(objective="time"), figures)
    assert probes == want
    assert all(e["bits"] == 32 for r in records for e in r["exchanges"])
    assert _probe_interval(AutoState(bits={"0/forward": 32}, interval=5, probes=1),
                           {"0/forward": 32}, 5, fp32_clear=True) == MAX_BACKOFF * 5
    # a decision that changed, or one that compresses, never takes the shortcut
    assert _probe_interval(AutoState(bits={"0/forward": 4}, interval=5, probes=1),
                           {"0/forward": 32}, 5, fp32_clear=True) == 5
    assert _probe_interval(AutoState(bits={"0/forward": 4}, interval=5, probes=1),
                           {"0/forward": 4}, 5, fp32_clear=True) == 10


def test_state_round_trips_through_a_checkpoint():
    state, _ = _run([2.0] + [1.0] * 7, [])
    a = AutoPolicy("s.toml", AutoSettings()).bind(10, 1)
    a.adopt(state)
    buf = io.BytesIO()
    torch.save({"autotune": a.state_dict()}, buf)         # as checkpoint.pt holds it
    b = AutoPolicy("s.toml", AutoSettings()).bind(10, 1)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["autotune"])
    assert b.state == state and b.state.window == [1.0, 1.0]


# -- the steps overrule the prediction ------------------------------------------------------------
def test_verify_steps_keeps_a_setting_only_while_its_steps_are_measurably_faster():
    bits = {"0/forward": 2, "0/backward": 32}
    sig = signature(bits)
    assert sig == "0/forward=2" and signature({"0/forward": 32}) == "fp32" == signature({})
    fast, slow = [0.030, 0.031, 0.029, 0.030], [0.050, 0.049, 0.052, 0.051]
    ref = [0.046, 0.047, 0.045, 0.046]
    verdict = lambda steps, gain=1.5, slower=(): verify_steps(steps, list(slower), bits, gain)[0]
    assert verdict({}) == "keep"                               # nothing timed: run it
    assert verdict({sig: slow}) == "reference"                 # unsure and fp32 never timed
    assert verdict({"0/forward=4": slow}) == "reference"       # any compressed window will do
    assert verdict({sig: slow}, gain=2.5) == "keep"            # a confident prediction: no check
    assert verdict({sig: slow[:2]}) == "keep"                  # two steps are not a median yet
    assert verdict({sig: fast, "fp32": ref}) == "keep"         # 35 % faster
    assert verdict({sig: slow, "fp32": ref}) == "fp32"
    assert verdict({sig: [0.045] * 4, "fp32": ref}) == "fp32"  # 2 % faster: within the noise
    assert verdict({sig: slow, "fp32": ref}, gain=100.0) == "fp32"   # measured beats predicted
    assert verdict({"fp32": ref}) == "keep"                    # not timed yet: one window to see
    assert verdict({sig: fast, "fp32": ref}, slower=[sig]) == "fp32"  # once slower, always
    # once some setting measured slower, an unsure prediction is not tried; a sure one is
    assert verdict({"fp32": ref}, slower=["0/forward=4"]) == "fp32"
    assert verdict({"fp32": ref}, gain=2.5, slower=["0/forward=4"]) == "keep"
    assert verify_steps({}, [], {"0/forward": 32}, 1.0)[0] == "keep"  # fp32 needs no check


def _figures_fast_link() -> Figures:
    """One exchange whose codec is nearly free and whose link costs 0.6 ms + 1.6 ns per byte:
    2 bits (error 0.15) predicted 0.64 ms against fp32's 1.0 ms, 1.6x cheaper: not certain."""
    fig = ExchangeFigures(FIG.norm2, dict(FIG.error2), {b: 1e-5 for b in BITS}, dict(FIG.bytes))
    return Figures({(0, "forward"): fig},
                   {"forward": [(256000.0, 0.0010), (70000.0, 0.0007)], "backward": []})


def _steps_run(figures: Figures, seconds: dict[str, float], epochs: int = 60):
    """Drive the policy as the trainer does (``run_epoch``): the setting a step ran with, the
    check, then that step's agreed seconds (``seconds[setting]``), probe epochs left out. The
    loss falls 10 % per epoch, so the budget admits 2 bits throughout. Returns the settings
    run, epoch by epoch, and the check records."""
    policy = AutoPolicy("s.toml", AutoSettings()).bind(epochs, 1)
    policy.adopt(start(AutoSettings(), figures.exchanges, figures.wire["forward"])[0])
    ran_all, records = [], []
    for epoch in range(epochs):
        probing = policy.due(epoch)
        ran = signature(policy.state.bits)
        ran_all.append(ran)
        policy.observe_loss(2.0 * 0.9 ** epoch)
        if policy.check(epoch):
            state, record = policy.decide(epoch, figures if probing else None)
            policy.adopt(state)
            records.append(record)
        if not probing:
            policy.observe_step(ran, seconds[ran])
    return ran_all, records


def test_a_setting_whose_steps_are_slower_than_fp32s_is_dropped_for_good():
    # shared memory on oversubscribed cores: predicted 1.6x cheaper, measured 17 % dearer
    ran, records = _steps_run(_figures_fast_link(), {"fp32": 0.046, "0/forward=2": 0.054})
    verdicts = [r["steps"]["verdict"] for r in records]
    # check 0: no step timed; 5: 2 bits timed (epochs 1-4), fp32 never: one window of fp32;
    # 10: fp32 timed (6-9), 2 bits slower: fp32 from then on, though the prediction says 2 bits
    assert verdicts[:3] == ["keep", "reference", "fp32"] and set(verdicts[3:]) == {"fp32"}
    assert ran[1:6] == ["0/forward=2"] * 5 and set(ran[6:]) == {"fp32"}
    assert records[-1]["exchanges"][0]["bits"] == 32
    # the probe at 10 was overruled: the next one MAX_BACKOFF windows on
    assert [r["epoch"] for r in records if r["probed"]] == [0, 5, 10, 10 + MAX_BACKOFF * 5]
    assert records[2]["steps"]["median_s"] == pytest.approx(0.054)
    assert records[2]["steps"]["fp32_median_s"] == pytest.approx(0.046)


def test_the_log_says_why_fp32_is_sent_untimed_settings_are_not_called_slower():
    """After a setting's steps overruled the prediction, a later setting predicted under 2x is
    never run: its log line said 'not faster' of steps never timed (every check of the run)."""
    from hpcgnn.autotune import steps_note
    _, records = _steps_run(_figures_fast_link(), {"fp32": 0.046, "0/forward=2": 0.054})
    measured = steps_note(records[2]["steps"])           # 2 bits timed slower than fp32
    assert "54.0 ms" in measured and "46.0 ms" in measured and "not 5% faster" in measured
    verdict, facts = verify_steps({"fp32": [0.046] * 4}, ["0/forward=2"], {"0/forward=4": 4}, 1.5)
    untimed = steps_note({**facts, "verdict": verdict})
    assert verdict == "fp32" and "faster" not in untimed and "untimed" in untimed
    assert "predicted 1.50x cheaper" in untimed and "2x" in untimed


def test_a_setting_whose_steps_are_faster_keeps_running_after_one_fp32_window():
    ran, records = _steps_run(_figures_fast_link(), {"fp32": 0.046, "0/forward=2": 0.030})
    assert [r["steps"]["verdict"] for r in records][:3] == ["keep", "reference", "keep"]
    assert ran[6:11] == ["fp32"] * 5 and set(ran[11:]) == {"0/forward=2"}   # one window only


def test_a_confident_prediction_spends_no_fp32_window():
    # the slow link of _figures: fp32 0.26 s against 2 bits' ~0.03 s per exchange
    ran, records = _steps_run(_figures(), {"fp32": 0.30, "0/backward=2,0/forward=2": 0.06})
    assert set(ran) == {"0/backward=2,0/forward=2"}
    assert {r["steps"]["verdict"] for r in records} == {"keep"}
    assert all(r["steps"]["predicted_gain"] > 2 for r in records)


def test_the_bytes_objective_ignores_step_times():
    state = AutoState(steps={"0/backward=2,0/forward=2": [1.0] * 4, "fp32": [0.1] * 4})
    new, record = decide(state, AutoSettings(objective="bytes"), _figures(), 0)
    assert set(new.bits.values()) == {2} and "steps" not in record


# -- the policy and its schedule file --------------------------------------------------------------
def _auto(tmp_path, text="", epochs=100, layers=3):
    path = tmp_path / "auto.toml"
    path.write_text('kind = "auto"\n' + text)
    return load_schedule(path).bind(epochs, layers)


# -- before epoch 0: the prior bound and the start ------------------------------------------------
def _relative_error(x: torch.Tensor, bits: int, keys: range) -> float:
    """Mean over ``keys`` of ||x - decode(encode(x))||^2 / ||x||^2, row by row, then averaged."""
    errs = []
    for key in keys:
        y = decode_values(encode_values(x, bits, key), x.shape[1], bits)
        errs.append(((y - x).double().pow(2).sum(1) / x.double().pow(2).sum(1)).mean().item())
    return sum(errs) / len(errs)


@pytest.mark.parametrize("width,bits", [(64, 4), (64, 8), (256, 4), (16, 2), (500, 8)])
def test_prior_error_bounds_the_rounding_error_of_any_row_and_is_nearly_attained(width, bits):
    # the bound's own arithmetic: width / (2 (2^b - 1)^2), bfloat16's rounding-up aside
    assert prior_error(width, bits) == pytest.approx(width / (2 * (2 ** bits - 1) ** 2), rel=0.02)
    assert prior_error(width, 32) == 0.0
    gauss = torch.randn(200, width, generator=torch.Generator().manual_seed(width + bits))
    assert _relative_error(gauss, bits, range(3)) < prior_error(width, bits)
    # the worst row: max = M, min = -M and zeros, which lie midway between two levels (the
    # number of steps is odd), so each rounds by half a step whichever way it goes (the error
    # is the same for every key); a step of 1/8 is exact in bfloat16
    levels, step = 2 ** bits - 1, 0.125
    m = levels * step / 2
    worst = torch.zeros(4, width)
    worst[:, 0], worst[:, 1] = m, -m
    rel = _relative_error(worst, bits, range(2))
    assert rel == pytest.approx((width - 2) * step ** 2 / 4 / (2 * m * m), rel=1e-6)
    assert 0.95 * (width - 2) / width * prior_error(width, bits) < rel < prior_error(width, bits)


def _prior(width: int, rows: int = 1000, codec_s: float = 0.0) -> ExchangeFigures:
    return prior_figures(width, {b: float(WireCodec(bits=b).block_bytes(rows, width))
                                 for b in (*BITS, 32)}, {b: codec_s for b in BITS})


def test_start_sends_the_cheapest_width_the_prior_allows_where_the_link_is_slow():
    slow = [(4.0e6, 0.040), (1.0e6, 0.010)]          # 10 ns per byte: 100 MB/s
    figs = {(0, "forward"): _prior(64), (0, "backward"): _prior(64), (1, "forward"): _prior(500),
            (2, "forward"): _prior(200_000, rows=1)}
    state, record = start(AutoSettings(), figs, slow)
    # width 64: 2 bits' bound is 3.6 > 1, 4 bits' 0.14; width 500: only 8 bits (4: 1.1); a
    # width of 200k has no candidate under 1 (8 bits: 1.5): fp32
    assert state.bits == {"0/forward": 4, "0/backward": 4, "1/forward": 8, "2/forward": 32}
    assert record["bits"] == state.bits
    assert state.wire == {d: [list(s) for s in slow] for d in DIRECTIONS}   # opens the history
    assert record["wire"]["beta_s_per_byte"] == pytest.approx(1e-8)
    assert state.probes == 0 and state.budget == 1.0 and state.next_probe == 0  # epoch 0 probes


def test_start_keeps_fp32_where_the_link_makes_bytes_free_or_the_codec_costs_more():
    free = [(4.0e6, 0.0010), (1.0e6, 0.0011)]         # no cost per byte within the noise
    assert start(AutoSettings(), {(0, "forward"): _prior(64)}, free)[0].bits == {"0/forward": 32}
    fast = [(4.0e6, 0.0004), (1.0e6, 0.0001)]         # 0.1 ns per byte; the codec 2 ms
    assert start(AutoSettings(), {(0, "forward"): _prior(64, codec_s=0.002)},
                 fast)[0].bits == {"0/forward": 32}


def test_start_on_the_bytes_objective_needs_no_timing():
    state, _ = start(AutoSettings(objective="bytes"),
                     {(0, "forward"): _prior(20, rows=1), (0, "backward"): _prior(16, rows=1),
                      (1, "forward"): _prior(2, rows=1), (1, "backward"): _prior(1, rows=1)}, [])
    # bounds: 2 bits 20/18 > 1 but 16/18 < 1; at width 2, 2 and 4 bits take 7 bytes (a 6-byte
    # header): a tie, to the more precise; at width 1 fp32's 4 bytes beat 1 bit's 7
    assert state.bits == {"0/forward": 4, "0/backward": 2, "1/forward": 4, "1/backward": 32}
    assert state.wire == {"forward": [], "backward": []}


def test_auto_defaults_and_codecs_follow_the_state(tmp_path):
    p = _auto(tmp_path)
    assert p.adaptive and p.settings == AutoSettings()
    assert p.forward_codec(0, 2, 3, 16) is IDENTITY and p.ratio(0, 0, 3) == 1.0   # fp32 first
    assert [c.bits for c in p.probe(0, 2, 3, "backward")] == [1, 2, 4, 8]   # last layer too
    assert p.probe(3, 0, 3, "forward") == ()                               # not a check
    p.state.bits = {"0/forward": 2, "2/backward": 8}
    assert p.forward_codec(7, 0, 3, 16) == WireCodec(bits=2) and p.ratio(7, 0, 3) == 16.0
    assert p.backward_codec(7, 2, 3, 16) == WireCodec(bits=8)


def test_auto_keys_are_honoured(tmp_path):
    p = _auto(tmp_path, 'bits = [8, 2]\nevery = 3\nobjective = "bytes"\n'
                        'compress_last_layer = false\ncompress_backward = false\n'
                        'probe_rows = 0\n')
    assert p.settings == AutoSettings(bits=(2, 8), every=3, objective="bytes",
                                      compress_last_layer=False, compress_backward=False,
                                      probe_rows=0)
    assert p.probe(3, 2, 3, "forward") == () and p.probe(3, 0, 3, "backward") == ()
    assert [c.bits for c in p.probe(3, 0, 3, "forward")] == [2, 8]
    assert p.forward_codec(0, 0, 3, 16) is IDENTITY                   # start: fp32 (a probe)
    p.state.bits = {"2/forward": 2, "0/backward": 2}
    assert p.forward_codec(3, 2, 3, 16) is IDENTITY and p.backward_codec(3, 0, 3, 16) is IDENTITY


def test_a_probe_leaves_out_candidates_far_over_the_budget_but_never_the_most_precise(tmp_path):
    p = _auto(tmp_path, layers=2)
    assert [c.bits for c in p.probe(0, 0, 2, "forward")] == [1, 2, 4, 8]   # first: all
    # FIG's errors: 1 bit 1.5, 2 bits 0.15, 4 bits 0.006, 8 bits 2e-5
    p.state.measured, p.state.probes, p.state.next_probe = {"0/forward": FIG.to_dict()}, 1, 5
    for budget, want in ((1.0, [1, 2, 4, 8]), (0.1, [2, 4, 8]), (0.01, [4, 8]),
                         (1e-6, [8])):
        p.state.budget = budget
        assert [c.bits for c in p.probe(5, 0, 2, "forward")] == want, budget
    # an exchange never measured before (here layer 1): all candidates
    assert [c.bits for c in p.probe(5, 1, 2, "forward")] == [1, 2, 4, 8]
    # a decision from figures without a candidate treats it as not admissible
    partial = ExchangeFigures(FIG.norm2, {4: 0.6, 8: 0.002}, {4: 0.005, 8: 0.006},
                              {4: 38000, 8: 70000, 32: 256000})
    assert partial.error(1) == math.inf
    assert choose(partial, BITS, math.inf, (0.0, 1e-6)) == 4


AUTO_BAD = [
    ('max_ratio = 8.0\n', "max_ratio", "chooses the rate itself"),
    ('slope = 5.0\n', "slope", "remove slope"),
    ('ratio = 4.0\n', "ratio", "curve kind"),
    ('codec = "truncate"\n', "codec", "codec = 'quant'"),
    ('bits = 4\n', "bits", "as a list"),
    ('bits = [3]\n', "bits", "[1, 2, 4, 8]"),
    ('bits = [2.0, 4.0]\n', "bits", "[1, 2, 4, 8]"),  # was accepted: a TypeError before epoch 0
    ('bits = []\n', "bits", "non-empty"),
    ('every = 0\n', "every", "every = 5"),
    ('probe_rows = -1\n', "probe_rows", "probe_rows = 2048"),
    ('probe_rows = 1.5\n', "probe_rows", "rows >= 0"),
    ('objective = "speed"\n', "objective", "time, bytes"),
    ('budget = 0.1\n', "budget", "unknown key"),
    ('[layers.0]\nbits = 2\n', "layers", "decides every layer"),
    ('[backward]\nkind = "constant"\n', "backward", "compress_backward = false"),
    ('epochs = 100\n', "epochs", "has no effect"),        # was accepted, and read by nothing
]


@pytest.mark.parametrize("text,key,message", AUTO_BAD)
def test_bad_auto_files_name_file_key_and_fix(tmp_path, text, key, message):
    path = tmp_path / "bad.toml"
    path.write_text('kind = "auto"\n' + text)
    with pytest.raises(ScheduleError) as err:
        load_schedule(path)
    got = str(err.value)
    assert str(path) in got and f"'{key}'" in got and message in got and "fix:" in got


def test_auto_is_a_whole_schedule_kind(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('codec = "truncate"\n[layers.1]\nkind = "auto"\n')
    with pytest.raises(ScheduleError, match="layers.1.kind.*top of the file"):
        load_schedule(path)


@pytest.mark.parametrize("sets,match", [
    (["train.staleness=1"], r"train.staleness >= 1 hides the wire time.*staleness = 0"),
    (["train.method=retexo", "train.rounds_per_layer=50", "train.epochs=100"],
     r"retexo.*no loop for kind = 'auto' to close"),
])
def test_auto_refusals_name_the_keys_and_the_fix(tmp_path, sets, match):
    from hpcgnn.combinations import check_combination
    from hpcgnn.config import ConfigError, load_config
    path = tmp_path / "auto.toml"
    path.write_text('kind = "auto"\n')
    with pytest.raises(ConfigError, match=match) as err:
        check_combination(load_config(None, sets), load_schedule(path))
    assert str(path) in str(err.value) and "kind = 'auto'" in str(err.value)


def test_start_times_a_codec_once_per_size():
    """Before epoch 0 a codec is timed once per (rows timed, width, bits): a layer's forward and
    backward exchanges, both over ``probe_rows``, share the timing, scaled by their rows."""
    from hpcgnn.train.autotuning import _codec_seconds
    timed = {}
    fwd = _codec_seconds(5000, 64, 4, 2048, torch.device("cpu"), timed)
    bwd = _codec_seconds(3000, 64, 4, 2048, torch.device("cpu"), timed)
    assert list(timed) == [(2048, 64, 4)] and fwd > 0
    assert bwd == pytest.approx(fwd * 3000 / 5000)
    small = _codec_seconds(100, 64, 4, 2048, torch.device("cpu"), timed)   # under the cap
    assert (100, 64, 4) in timed and small == pytest.approx(timed[(100, 64, 4)])


def test_a_codec_is_timed_by_its_work_not_by_a_wait():
    """``busy_seconds`` on the CPU: a rank descheduled mid-timing (here: asleep) does not pass
    the wait for the codec's cost; work does count."""
    import time
    from hpcgnn.comm.exchange import busy_seconds
    cpu = torch.device("cpu")
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(0.2)
    assert busy_seconds(t0, c0, cpu) < 0.1
    t0, c0 = time.perf_counter(), time.process_time()
    while time.process_time() - c0 < 0.05:
        pass
    assert 0.05 <= busy_seconds(t0, c0, cpu) <= time.perf_counter() - t0


def test_auto_with_nothing_it_may_compress_is_refused_at_bind(tmp_path):
    """``compress_last_layer = false`` on a 1-layer model leaves ``auto`` nothing to decide: the
    run would be full communication under an ``auto`` schedule, so binding refuses it (as a
    curve schedule's bind does); a 2-layer model binds."""
    path = tmp_path / "auto.toml"
    path.write_text('kind = "auto"\ncompress_last_layer = false\n')
    policy = load_schedule(path)
    with pytest.raises(ScheduleError) as err:
        policy.bind(10, 1)
    got = str(err.value)
    assert str(path) in got and "'compress_last_layer'" in got and "fix: set compress_last_layer = true" in got
    assert policy.bind(10, 2).compresses(0, 2, "forward")


def test_a_codec_keeps_the_least_time_it_was_measured_at():
    """A codec's cost is a property of the sizes: a later probe that timed it slower (a busy
    core) does not raise it, a faster one lowers it."""
    def scaled(factor: float) -> Figures:
        fig = ExchangeFigures(FIG.norm2, FIG.error2,
                              {b: s * factor for b, s in FIG.codec_s.items()}, FIG.bytes)
        return Figures({(0, "forward"): fig}, {"forward": [(256000.0, 0.26)], "backward": []})

    settings, state = AutoSettings(objective="time"), AutoState()
    for epoch, factor, want in ((0, 1.0, 1.0), (1, 10.0, 1.0), (2, 0.5, 0.5)):
        state.window.append(1.0)
        state, _ = decide(state, settings, scaled(factor), epoch)
        got = state.measured["0/forward"]["codec_s"]
        assert {int(b): s for b, s in got.items()} == \
            pytest.approx({b: s * want for b, s in FIG.codec_s.items()}), epoch
