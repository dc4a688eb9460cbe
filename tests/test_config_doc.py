"""docs/configuration.md is generated from the configuration's source (tierckpt_dev/gen_config_doc.py):
the committed file must equal the generator's output, so the reference cannot drift from
TierConfig, ScheduleOptions, the torchtitan [checkpoint] keys or the Megatron flags."""

from __future__ import annotations

import dataclasses

from tierckpt.config import ScheduleOptions, TierConfig
from tierckpt_dev import gen_config_doc as gen


def test_committed_configuration_doc_is_the_generated_one():
    with open(gen.DOC_PATH) as f:
        committed = f.read()
    assert committed == gen.render(), (
        "docs/configuration.md is out of date: run python -m tierckpt_dev.gen_config_doc")


def test_every_option_is_documented_with_its_mappings():
    text = gen.render()
    names = [f.name for f in dataclasses.fields(TierConfig)] + [
        f"schedule.{f.name}" for f in dataclasses.fields(ScheduleOptions)]
    for name in names:
        assert f"| `{name}` |" in text, name
    assert gen.undocumented() == []
    fields = {f.name: f for f in gen.collect()[0]}
    # the renames of both front-ends are read from their modules, not guessed
    assert fields["persistent_root"].toml == "`checkpoint.persistent_folder`"
    assert fields["persistent_root"].flag == "`--save`"
    assert fields["warn_only"].toml == "`checkpoint.warn_only_tiers`"
    assert fields["schedule.gpu_mtbf_s"].flag == "`--ckpt-plugin-gpu-mtbf-hours`"
    assert fields["keep_latest_k"].toml == ("local: `checkpoint.local_keep_latest_k`, "
                                            "persistent: `checkpoint.keep_latest_k`")
    assert fields["transfer_chunk_bytes"].toml == "—"
    keys = {k.name for k in gen.collect()[1]}
    assert {"local_interval", "local_root", "preemption_signals", "cpu_staging"} <= keys
    flags = {f.flag for f in gen.collect()[2]}
    assert {"--ckpt-plugin-enable", "--ckpt-plugin-local-root", "--ckpt-plugin-cpu-staging"} <= flags


def test_attribute_docs_parser():
    @dataclasses.dataclass
    class C:
        """Example.

        Attributes:
            a: first line
                continued.
            b, c: shared
                text.
            d:
                on the next line.

        Raises:
            ValueError: not an attribute.
        """

        a: int = 1
        b: int = 2
        c: int = 3
        d: int = 4  # why d
        e: int = 5  # only a comment

    docs = gen.attribute_docs(C)
    assert docs == {"a": "first line continued.", "b": "shared text.", "c": "shared text.",
                    "d": "on the next line."}
    got = {f.name: f.text for f in gen.field_docs(C, "", lambda n: "—", lambda n: "—")}
    assert got["d"] == "on the next line." and got["e"] == "only a comment"


def test_check_mode(tmp_path):
    out = tmp_path / "configuration.md"
    assert gen.main(["--check", "--out", str(out)]) == 1
    assert gen.main(["--out", str(out)]) == 0
    assert gen.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert gen.main(["--check", "--out", str(out)]) == 1
