"""Training: config, data, the two objectives (distill.py and evict.py, behind objectives.py) and the loop
behind ``train.py`` (also ``python -m retention.train``)."""

import argparse
import logging

from .config import Config, ConfigError, load_config

log = logging.getLogger(__name__)

__all__ = ["Config", "ConfigError", "load_config", "main"]


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """The training command line; ``prog``: how usage lines and errors name it."""
    # how accelerate launches this command: a script by its path, a module (`retention train` too) with -m
    launched = prog if prog.endswith(".py") else f"-m {prog.removeprefix('python -m ')}"
    parser = argparse.ArgumentParser(
        prog=prog, description=f"Train retention gates: accelerate launch {launched} --config <name>.yaml",
    )
    parser.add_argument("--config", required=True,
                        help="YAML file, or a bare recipe name (configs/ of a checkout, else the packaged copy)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="continue a run: 'latest' (default) or a checkpoint folder")
    parser.add_argument("--push_to_hub", "--push-to-hub", dest="push_to_hub", default=None, metavar="REPO_ID",
                        help="upload the exported gates to this Hub repo")
    parser.add_argument("--export", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                        help="no training: export the gates of a checkpoint ('latest' or a folder) of this run")
    parser.add_argument("--to", default=None, metavar="DIR",
                        help="with --export: the folder to write (default: export.dir)")
    args = parser.parse_args(argv)
    try:
        return _run(parser, args, prog)
    except SystemExit as e:
        # a check's SystemExit(message) (no checkpoint to --resume, a config changed since the run started, ...):
        # Python exited with status 1 and no "PROG: error:", unlike the command's other errors
        if not isinstance(e.code, str):
            raise
        parser.exit(2, f"{prog}: error: {e.code}\n")


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, prog: str) -> int:
    """:func:`main` from its parsed arguments."""
    if args.to is not None and args.export is None:  # else a whole fresh run started, and --to went unread
        parser.error("--to names the folder an --export writes: add --export (no training), or set export.dir "
                     "(--set export.dir=DIR) for where a training run exports")
    if args.export is not None and args.resume is not None:
        parser.error("--export takes the checkpoint itself (--export latest, or --export CHECKPOINT_FOLDER): "
                     "drop --resume")
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        parser.exit(2, f"config error: {e}\n")
    if args.export is not None:
        from retention.hub import HubError

        from .loop import export_checkpoint

        repo, dest = args.push_to_hub or cfg.export.push_to_hub, None
        try:
            if repo:  # a missing token fails before anything is written
                from retention.hub import check_push_target

                check_push_target(repo)
            dest = export_checkpoint(cfg, args.export, args.to)
            log.info(f"gates exported to {dest}")
            if repo:
                from retention.hub import push_to_hub

                log.info(f"pushed: {push_to_hub(dest, repo)}")
        except (FileNotFoundError, FileExistsError) as e:  # no such checkpoint; --to a folder of other files
            parser.exit(2, f"error: {str(e).replace('--resume', '--export')}\n")
        except HubError as e:  # no token, a repo id that cannot be, no network
            kept = f"; the gates are exported to {dest}" if dest is not None else ""
            parser.exit(2, f"error: {e}{kept}\n")
        return 0
    from retention.commands import user_errors

    from .loop import train
    from .sources import DataError

    try:
        train(cfg, resume=args.resume, push_to_hub_repo=args.push_to_hub)
    except (*user_errors(), DataError) as e:  # a model that cannot load, unreadable data: the message names the fix
        parser.exit(2, f"{prog}: error: {e}\n")
    except KeyboardInterrupt:  # Ctrl-C twice (once stops after the step with a checkpoint), or before training
        parser.exit(130, f"\n{prog}: interrupted; --resume continues from the latest checkpoint, if one was written\n")
    return 0
