"""Schedule files: the formulas against hand-computed values, overrides, and rejected files."""
from pathlib import Path

import pytest

from hpcgnn.codecs import IDENTITY
from hpcgnn.schedule import ScheduleError, load_schedule, parse_schedule

SHIPPED = sorted((Path(__file__).parents[1] / "configs" / "schedules").glob("*.toml"))


def _policy(text: str, tmp_path, epochs=200, layers=2):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return load_schedule(path).bind(epochs, layers)


def test_linear_matches_the_authors_formula_by_hand(tmp_path):
    p = _policy('codec = "truncate"\nkind = "linear"\nmax_ratio = 128.0\nmin_ratio = 1.0\n'
                'slope = 5.0\n', tmp_path, epochs=200, layers=3)
    # r(t) = max(1, 128 - 5 t 127 / 198)
    assert p.ratio(0, 0, 3) == 128.0
    assert p.ratio(10, 0, 3) == pytest.approx(95.929292929)
    assert p.ratio(39, 1, 3) == pytest.approx(2.924242424)
    assert p.ratio(40, 0, 3) == 1.0 and p.ratio(199, 0, 3) == 1.0
    assert p.ratio(0, 2, 3) == 1.0  # the last layer is never compressed by default
    assert p.forward_codec(10, 0, 3, 192).k == 2  # floor(192 / 95.93)
    assert p.forward_codec(40, 0, 3, 192) is IDENTITY


def test_exponential_step_table_constant_by_hand(tmp_path):
    exp = _policy('kind = "exponential"\nmax_ratio = 128.0\nmin_ratio = 1.0\nslope = 5.0\n',
                  tmp_path, epochs=202)
    assert exp.ratio(20, 0, 2) == pytest.approx(128 ** 0.5)  # frac = 5 * 20 / 200 = 1/2
    assert exp.ratio(40, 0, 2) == pytest.approx(1.0) and exp.ratio(41, 0, 2) == 1.0
    step = _policy('kind = "step"\nmax_ratio = 64.0\nevery = 10\n', tmp_path)
    assert [step.ratio(t, 0, 2) for t in (0, 9, 10, 25, 60, 100)] == [64, 64, 32, 16, 1, 1]
    table = _policy('kind = "table"\n[[phase]]\nuntil_epoch = 5\nratio = 32.0\n'
                    '[[phase]]\nuntil_epoch = 9\nratio = 4.0\n', tmp_path)
    assert [table.ratio(t, 0, 2) for t in (0, 4, 5, 8, 9, 150)] == [32, 32, 4, 4, 4, 4]
    const = _policy('kind = "constant"\nratio = 8.0\n', tmp_path)
    assert const.ratio(123, 0, 2) == 8.0


def test_layer_and_backward_overrides(tmp_path):
    p = _policy('codec = "truncate"\nkind = "constant"\nratio = 8.0\ncompress_last_layer = true\n'
                '[backward]\ncodec = "quant"\n[layers.1]\nratio = 2.0\n'
                '[layers.1.backward]\nkind = "constant"\nratio = 32.0\n', tmp_path)
    assert p.ratio(0, 0, 2) == 8.0 and p.ratio(0, 1, 2) == 2.0
    assert p.forward_codec(0, 0, 2, 16).k == 2 and p.forward_codec(0, 1, 2, 16).k == 8
    assert repr(p.backward_codec(0, 0, 2, 16)) == "quant(4)"  # ratio 8 -> 4 bits
    assert repr(p.backward_codec(0, 1, 2, 16)) == "quant(1)"


def test_an_override_codec_drops_the_inherited_stage_settings(tmp_path):
    p = _policy('codec = "truncate+quant"\nbits = 4\nkind = "constant"\nratio = 8.0\n'
                '[backward]\ncodec = "quant"\n[layers.0]\ncodec = "sample+quant"\nbits = 2\n',
                tmp_path)
    assert repr(p.backward_codec(0, 1, 3, 16)) == "quant(4)"  # bits from ratio 8, not bits = 4
    assert repr(p.forward_codec(0, 0, 3, 16)) == "sample(0.125)+quant(2)"


def test_quant_bits_in_an_override_replace_the_inherited_curve(tmp_path):
    """``bits = b`` is codec 'quant''s constant ratio 32 / b in an override too: it was refused
    as 'bits and backward.max_ratio both set the rate', naming a key the table did not have.
    Likewise an override's kind replaces inherited bits."""
    p = _policy('codec = "truncate"\nkind = "linear"\nmax_ratio = 16.0\n'
                '[backward]\ncodec = "quant"\nbits = 2\n', tmp_path, epochs=12)
    assert p.ratio(0, 0, 2) == 16.0 and repr(p.forward_codec(0, 0, 2, 16)) == "truncate(k=1)"
    assert [repr(p.backward_codec(t, 0, 2, 16)) for t in (0, 11)] == ["quant(2)"] * 2
    q = _policy('codec = "quant"\nbits = 2\ncompress_last_layer = true\n'
                '[layers.1]\nkind = "constant"\nratio = 32.0\n[layers.0.backward]\nbits = 8\n',
                tmp_path)
    assert [repr(q.forward_codec(0, layer, 2, 16)) for layer in (0, 1)] == ["quant(2)", "quant(1)"]
    assert [repr(q.backward_codec(0, layer, 2, 16)) for layer in (0, 1)] == ["quant(8)", "quant(1)"]
    with pytest.raises(ScheduleError, match="bits and layers.0.slope both set the rate"):
        _policy('codec = "quant"\nbits = 2\n[layers.0]\nslope = 3.0\n', tmp_path)  # which curve?


def test_combined_codecs_and_flags(tmp_path):
    p = _policy('codec = "truncate+quant"\nbits = 4\nkind = "constant"\nratio = 4.0\n'
                'compress_backward = false\n', tmp_path)
    codec = p.forward_codec(0, 0, 2, 16)
    assert (codec.channels, codec.k, codec.bits, codec.keep) == ("truncate", 4, 4, 1.0)
    assert codec.byte_counts([10], 16) == [10 * (6 + 2)]
    assert p.backward_codec(0, 0, 2, 16) == IDENTITY and p.forward_codec(0, 1, 2, 16) == IDENTITY
    s = _policy('codec = "sample"\nkind = "constant"\nratio = 4.0\n', tmp_path)
    assert (s.forward_codec(0, 0, 2, 16).keep, s.forward_codec(0, 0, 2, 16).channels) == (0.25, "all")


def test_learned_layers_get_modules(tmp_path):
    p = _policy('codec = "learned"\n', tmp_path)
    enc, dec = p.layer_modules(0, 16)
    assert enc.weight.shape == (16, 16) and dec is not None
    assert p.layer_modules(1, 16) == (None, None)  # last layer: uncompressed


def test_linear_needs_the_epoch_count(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('kind = "linear"\n')
    with pytest.raises(ScheduleError, match="bind"):
        load_schedule(path).ratio(0, 0, 2)
    path.write_text('kind = "linear"\nepochs = 102\n')
    assert load_schedule(path).ratio(10, 0, 2) == pytest.approx(128 - 50 * 127 / 100)


BAD = [
    ('codec = "truncate"\nmax_ration = 8.0\n', "max_ration", "did you mean 'max_ratio'"),
    ('kind = "constant"\nratio = 0.5\n', "'ratio'", "below 1"),
    ('min_ratio = 0.0\n', "min_ratio", "below 1"),
    ('max_ratio = 2.0\nmin_ratio = 8.0\n', "max_ratio", "increase"),
    ('slope = -1.0\n', "slope", "never decreases"),
    ('kind = "step"\nmax_ratio = 8.0\n', "every", "every = 20"),
    ('kind = "step"\nevery = 5\nfactor = 0.5\n', "factor", "never decreases"),
    ('kind = "table"\n[[phase]]\nuntil_epoch = 5\nratio = 4.0\n[[phase]]\nuntil_epoch = 9\n'
     'ratio = 8.0\n', "phase[1].ratio", "increases"),
    ('kind = "table"\n', "phase", "[[phase]]"),
    ('kind = "wavy"\n', "kind", "constant, linear"),
    ('kind = "linear"\nratio = 4.0\n', "'ratio'", "kind = 'constant'"),
    ('codec = "zip"\n', "codec", "unknown codec"),
    ('codec = "truncate+quant"\n', "bits", "bits = 4"),
    ('codec = "truncate"\nbits = 4\n', "bits", "no quant stage"),
    ('codec = "quant"\nbits = 4\nmax_ratio = 8.0\n', "bits", "bits and max_ratio both set"),
    ('codec = "quant"\nbits = 2\nkind = "linear"\nslope = 2.0\n', "bits", "kind, slope"),
    ('[layers.0]\ncodec = "quant"\nbits = 4\nratio = 8.0\n', "layers.0.bits", "layers.0.ratio"),
    ('codec = "quant"\nbits = 3\n', "bits", "(1, 2, 4, 8)"),
    ('codec = "truncate+quant"\nbits = 3\n', "bits", "got 3; fix: set bits = 4"),  # not 'add' it
    ('codec = "sample+truncate"\nkeep = 2\n', "keep", "got 2; fix: set keep = 0.5"),
    ('codec = "truncate+quant"\nbits = 2.0\n', "bits", "(1, 2, 4, 8)"),  # a TypeError at epoch 0
    ('codec = "sample+truncate"\n', "keep", "keep = 0.5"),
    ('codec = "sample+truncate"\nkeep = 0.05\n', "keep", "[0.125, 1], got 0.05"),  # sent 1/8
    ('codec = "sample+truncate"\nkeep = 0\n', "keep", "[0.125, 1], got 0"),
    ('codec = "sample+truncate"\nkeep = 1.5\n', "keep", "[0.125, 1], got 1.5"),
    ('compress_backward = "yes"\n', "compress_backward", "true or false"),
    ('[layers.x]\nratio = 2.0\n', "layers.x", "[layers.0]"),
    ('[layers.0]\nspeed = 2.0\n', "layers.0.speed", "unknown key"),
    ('[backward]\nslope = 0.0\n', "backward.slope", "never decreases"),
    ('max_ratio = "big"\n', "max_ratio", "expected a number"),
    ('codec = \n', "", "not valid TOML"),
    ('', "", "sets no key"),                                 # ran VARCO's 128 -> 1 silently
    ('# a schedule to come\n', "", "leave out --schedule"),
    ('[model]\nhidden = 16\n[train]\nepochs = 5\n', "'model'", "pass it with --config"),
    ('kind = "constant"\nratio = 4.0\nslope = 3.0\n', "'slope'", "has no effect"),
    ('kind = "constant"\nratio = 4.0\nmax_ratio = 8.0\n', "'max_ratio'", "reads ratio"),
    ('kind = "linear"\nmax_ratio = 8.0\nevery = 3\n', "'every'", "max_ratio, min_ratio, slope"),
    ('kind = "step"\nevery = 2\nslope = 3.0\n', "'slope'", "has no effect"),
    ('kind = "constant"\nratio = 4.0\n[[phase]]\nuntil_epoch = 3\nratio = 2.0\n', "'phase'",
     "has no effect"),
    ('kind = "table"\nmax_ratio = 8.0\n[[phase]]\nuntil_epoch = 3\nratio = 2.0\n',
     "'max_ratio'", "reads only phase"),
    ('[layers.0]\nkind = "constant"\nratio = 2.0\nfactor = 2.0\n', "layers.0.factor",
     "has no effect"),
    ('[backward]\nkind = "constant"\nratio = 2.0\nmin_ratio = 1.0\n', "backward.min_ratio",
     "has no effect"),
    ('kind = "constant"\nratio = inf\n', "'ratio'", "inf is not a finite number"),
    ('kind = "step"\nevery = 5\nepochs = 100\n', "'epochs'", "has no effect"),
    ('kind = "atuo"\n', "'kind'", "step, table, auto"),            # auto was not offered
    ('objective = "bytes"\n', "'objective'", "add kind = 'auto'"),     # was 'unknown key' 
    ('compress_backward = false\n[backward]\ncodec = "quant"\n', "'backward'",
     "compress_backward = true"),
    ('compress_backward = false\n[layers.0.backward]\nratio = 2.0\n', "layers.0.backward",
     "has no effect"),
    # A forward that selects rows or channels takes only a value stage from [backward]: these
    # ran the forward's adjoint (its k channels, its rows) and ignored the table's codec and rate.
    ('codec = "truncate"\n[backward]\nkind = "constant"\nratio = 128.0\n', "'backward'",
     "has no effect while the forward"),
    ('codec = "truncate"\n[backward]\ncodec = "random"\n', "'backward'", "codec = 'quant'"),
    ('codec = "sample"\nkind = "constant"\nratio = 2.0\n[backward]\nratio = 4.0\n',
     "'backward'", "has no effect while the forward"),
    ('kind = "constant"\nratio = 4.0\n[layers.0.backward]\ncodec = "sample+truncate"\n'
     'keep = 0.5\n', "'layers.0.backward'", "has no effect while the forward"),
    # 'learned' names an encoder/decoder pair around the forward exchange; as a backward codec of
    # its own it truncated the gradients with no pair at all.
    ('codec = "quant"\nbits = 4\n[backward]\ncodec = "learned"\nkind = "constant"\n'
     'ratio = 4.0\n', "'backward.codec'", "learned encoder and decoder"),
]


@pytest.mark.parametrize("text,key,message", BAD)
def test_bad_files_are_rejected_naming_file_key_and_fix(tmp_path, text, key, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScheduleError) as err:
        load_schedule(path)
    text = str(err.value)
    assert str(path) in text and key in text and message in text and "fix:" in text


def test_keys_for_the_top_curve_stay_allowed_beside_an_override_of_another_kind(tmp_path):
    """``[backward] slope`` tunes the top-level linear curve; layer 0's constant override does
    not read it, and that is no mistake of the file (only the keys a table sets are checked
    against its own kind)."""
    p = _policy('codec = "quant"\nkind = "linear"\nmax_ratio = 8.0\nslope = 1.0\n[backward]\n'
                'slope = 2.0\n[layers.0]\nkind = "constant"\nratio = 4.0\n', tmp_path, epochs=12,
                layers=3)
    assert p.ratio(5, 0, 3) == 4.0 and p.ratio(5, 1, 3) == pytest.approx(8.0 - 5 * 7 / 10)
    assert p._ratio(p._rules(1).backward, 5) == pytest.approx(max(1.0, 8.0 - 10 * 7 / 10))


def test_layer_override_beyond_the_model_is_rejected_at_bind(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[layers.3]\nmax_ratio = 4.0\n')
    with pytest.raises(ScheduleError, match="layers.3.*has 2 layers"):
        load_schedule(path).bind(100, 2)


def test_an_override_of_the_uncompressed_last_layer_is_rejected_at_bind(tmp_path):
    """compress_last_layer = false keeps the last layer fp32: its override compressed nothing
    (the run sent fp32 where the file asked for ratio 4)."""
    path = tmp_path / "s.toml"
    path.write_text('kind = "constant"\nratio = 8.0\n[layers.1]\nratio = 4.0\n')
    with pytest.raises(ScheduleError, match=r"'layers.1': has no effect.*compress_last_layer = "
                                            r"false.*fix: set compress_last_layer = true"):
        load_schedule(path).bind(100, 2)
    assert load_schedule(path).bind(100, 3).ratio(0, 1, 3) == 4.0     # not the last of 3
    path.write_text('kind = "constant"\nratio = 8.0\ncompress_last_layer = true\n'
                    '[layers.1]\nratio = 4.0\n')
    assert load_schedule(path).bind(100, 2).ratio(0, 1, 2) == 4.0


def test_a_schedule_that_compresses_no_layer_of_the_model_is_rejected_at_bind(tmp_path):
    """varco.toml on a 1-layer model: its one layer is the last, which compress_last_layer =
    false keeps fp32, so the run was full communication under a VARCO schedule (ratio 1.0 in
    every record). Likewise where the only other layers' overrides say codec = 'none'."""
    varco = Path(__file__).parents[1] / "configs" / "schedules" / "varco.toml"
    with pytest.raises(ScheduleError, match=rf"schedule {varco}: key 'compress_last_layer': has "
                                            r"no effect.*1-layer.*fix: set compress_last_layer "
                                            r"= true"):
        load_schedule(varco).bind(100, 1)
    assert load_schedule(varco).bind(100, 2).ratio(0, 0, 2) == 128.0
    path = tmp_path / "s.toml"
    path.write_text('kind = "constant"\nratio = 8.0\n[layers.0]\ncodec = "none"\n')
    with pytest.raises(ScheduleError, match="'compress_last_layer': has no effect.*2-layer"):
        load_schedule(path).bind(100, 2)
    assert load_schedule(path).bind(100, 3).ratio(0, 1, 3) == 8.0
    path.write_text('codec = "none"\n')                    # full.toml: fp32 on purpose
    assert load_schedule(path).bind(100, 1).ratio(0, 0, 1) == 1.0
    path.write_text('kind = "constant"\nratio = 8.0\ncompress_last_layer = true\n')
    assert load_schedule(path).bind(100, 1).ratio(0, 0, 1) == 8.0


def test_missing_file(tmp_path):
    with pytest.raises(ScheduleError, match="not found"):
        load_schedule(tmp_path / "nope.toml")


def test_a_directory_or_binary_file_names_the_schedule(tmp_path):
    """The errors were Python's alone ('utf-8' codec can't decode byte ...), without the file."""
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(b"\x97\xff\x00codec")
    for name in ("dir.toml", "bin.toml"):
        with pytest.raises(ScheduleError, match=rf"schedule {tmp_path / name}: cannot be read "
                                                r"as a TOML text file .*fix: pass a schedule"):
            load_schedule(tmp_path / name)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_schedules_load(path):
    policy = load_schedule(path).bind(200, 2)
    assert policy.ratio(0, 0, 2) >= policy.ratio(199, 0, 2) >= 1.0


def test_parse_schedule_defaults_are_the_design_example():
    p = parse_schedule({}).bind(200, 2)
    assert p.ratio(0, 0, 2) == 128.0 and p.compress_backward and not p.compress_last_layer


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quant_bits_alone_set_a_constant_rate(tmp_path, bits):
    """``codec = "quant"`` with ``bits = b`` and no ratio keys: ratio 32 / b, b bits, every epoch."""
    p = _policy(f'codec = "quant"\nbits = {bits}\n', tmp_path, epochs=50)
    for t in (0, 25, 49):
        assert p.ratio(t, 0, 2) == 32 / bits and p.ratio(t, 1, 2) == 1.0   # last layer: fp32
        assert repr(p.forward_codec(t, 0, 2, 16)) == f"quant({bits})"
        assert repr(p.backward_codec(t, 0, 2, 16)) == f"quant({bits})"
