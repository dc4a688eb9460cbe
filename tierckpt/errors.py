"""Exception types raised by tierckpt (all derive from :class:`TierckptError`)."""


class TierckptError(Exception):
    """Base class of every error tierckpt raises on purpose."""


class ConfigError(TierckptError, ValueError):
    """An option has a value tierckpt cannot use.

    The message always names the option (e.g. ``replication_factor``) and the allowed values,
    so a user can fix the launch line or config file without reading source.
    """

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"{option}: {message}")


class VerificationError(TierckptError, RuntimeError):
    """A checkpoint's bytes do not match its manifest (size or xxhash), or it has no manifest."""


class NoCheckpointError(TierckptError, RuntimeError):
    """Committed checkpoints exist, but none of them could be restored from any source."""


class TemplateMismatchError(TierckptError, RuntimeError):
    """The state dict handed to ``restore()`` does not fit the step being restored: a key the
    template has and the checkpoint lacks, another dtype, another global shape, or a tensor
    where the checkpoint holds an object (or the reverse). Raised on every rank before any
    source is read or any directory changed (:mod:`tierckpt.restore.template`): it is a
    property of the template, so no other source is tried.

    The message's first line names the key, the saved value and the template's, e.g.
    ``model.0.weight: checkpoint dtype torch.float32 != template torch.bfloat16``; the next
    lines say where it was found and summarise further mismatches.

    Attributes:
        step: the step the template was checked against.
        problems: ``[(global rank, [mismatch, …], mismatches on that rank)]`` of the lowest
            ranks that found any (at most 4 ranks, 8 mismatches each).
        ranks: how many ranks found a mismatch.
    """

    def __init__(self, step: int, problems: list[tuple[int, list[str], int]], ranks: int, where: str):
        self.step, self.problems, self.ranks = step, problems, ranks
        rank, mine, count = problems[0]
        first = mine[0]
        lines = [first,
                 f"tierckpt restore: the state dict does not match step {step} ({where}): {count} mismatch(es) on "
                 f"rank {rank}" + (f", and mismatches on {ranks - 1} other rank(s)" if ranks > 1 else "")
                 + "; nothing was read or changed, no other source was tried"]
        rest = "; ".join(dict.fromkeys(p for _, ps, _ in problems for p in ps if p != first))
        if rest:
            lines.append("also: " + (rest if len(rest) <= 400 else rest[:400] + " …"))
        super().__init__("\n".join(lines))


class TierFailedError(TierckptError, RuntimeError):
    """A tier's background save failed and the tier is not ``warn_only``: raised by the next
    ``save()`` of that tier, by ``wait(raise_failures=True)`` and by a clean ``close()``.

    Attributes:
        tier: the tier (``"local"`` or ``"persistent"``).
        step: the step whose save failed.
        cause: the first error any rank reported (e.g. ``"OSError: [Errno 28] No space left"``).
    """

    def __init__(self, tier: str, step: int, cause: str | None):
        self.tier, self.step, self.cause = tier, step, cause
        super().__init__(f"tierckpt: the {tier} tier's save of step {step} failed: {cause or 'unknown error'} "
                         f"(step {step} is not a durable {tier} step of this run; earlier committed steps are "
                         f"intact; add {tier!r} to warn_only to let training continue without it)")


class TierUnreachableError(TierFailedError):
    """A restore found nothing to restore from but a tier whose root did not answer (its
    listing made no progress for ``restore_read_timeout_s``: a hung shared file system).
    Raised on every rank instead of a fresh start, which would silently discard the progress
    that tier may hold.

    Attributes:
        tier: the tier (``"persistent"``); ``step``: -1 (no step is known);
        path: the root that did not answer; cause: the timeout's message.
    """

    def __init__(self, tier: str, path: str, cause: str | None):
        self.tier, self.step, self.cause, self.path = tier, -1, cause, path
        RuntimeError.__init__(self, f"tierckpt: the {tier} tier's root {path} did not answer ({cause or 'timed out'}) "
                              "and no other tier holds a restorable step: refusing to start fresh over "
                              f"checkpoints that may exist there; fix the mount (or remove {tier!r} from tiers "
                              "to start without it)")


class StagingError(TierckptError, RuntimeError):
    """A staged copy is not a snapshot of the state at ``save()`` (``cpu_staging =
    "overlapped"``: a saved tensor was modified in place before the background copy was waited
    for, or the copy failed). The save of that step fails on every tier it was staged for;
    committed steps are untouched."""


class ReadTimeout(TierckptError, TimeoutError):
    """A read of a restore's source made no progress for ``restore_read_timeout_s`` seconds (a
    hung NFS/NVMe read, a file that blocks on open): the source counts as failed, like a
    corrupt one, and the restore falls back to the next source."""


class DCPInternalsChanged(TierckptError, ImportError):
    """The installed torch lacks a name of torch.distributed.checkpoint (DCP) that tierckpt's
    staging, planners or readers use beyond DCP's documented API (a private module, a planner
    method, a dataclass field, an attribute a reader sets): raised when tierckpt's DCP-using
    modules are first imported (:mod:`tierckpt.io.dcp_compat`), before any save or restore, so
    a torch upgrade fails at start-up, not halfway through a save.

    Attributes:
        missing: ``["torch.distributed.checkpoint.filesystem._StorageInfo.offset", …]``, every
            missing name (what each is used for is in the message).
        torch_version: ``torch.__version__`` of the process.
    """

    def __init__(self, missing: list[tuple[str, str]], torch_version: str, supported: str):
        self.missing, self.torch_version = [name for name, _ in missing], torch_version
        first, used_by = missing[0]
        more = f" (and {len(missing) - 1} more: {', '.join(self.missing[1:4])}{' …' if len(missing) > 4 else ''})"
        super().__init__(f"tierckpt: torch {torch_version} has no {first}, which tierckpt's {used_by} relies on"
                         f"{more if len(missing) > 1 else ''}; torch.distributed.checkpoint's internals changed. "
                         f"tierckpt is tested on torch {supported}: install one of those "
                         "(README, 'Supported versions')")
