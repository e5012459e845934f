"""`tokios keys create|list|revoke`: manage client API keys and connector tokens.

Wires options to gateway/keys.py. A secret is printed once, at creation, and cannot be shown
again; `list` shows ids, names, scopes and limits only (and says so when the store holds none).
Without an action it prints its help, as `tokios` without a command does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from tokios.errors import NotFoundError
from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyStore, default_db_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, help="key store (default $TOKIOS_GATEWAY_DB or ~/.local/share/tokios/gateway.db)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    create = actions.add_parser("create", help="create a key and print its secret once")
    create.add_argument("--kind", choices=[KIND_CLIENT, KIND_CONNECTOR], default=KIND_CLIENT)
    create.add_argument("--name", default="")
    create.add_argument("--models", default="", help="comma-separated models this key may use (default: all)")
    create.add_argument("--rpm", type=int, default=None, help="max requests per minute")
    create.add_argument("--tpm", type=int, default=None, help="max tokens per minute")
    create.add_argument("--max-concurrent", type=int, default=None)
    create.add_argument("--json", action="store_true")

    listing = actions.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--json", action="store_true")

    revoke = actions.add_parser("revoke", help="revoke a key by id; takes effect at once")
    revoke.add_argument("key_id")
    parser.set_defaults(_keys_parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.action is None:
        # As `tokios` and `tokios bench` without a command: the help, and the same exit status.
        args._keys_parser.print_help()
        return 2
    store = KeyStore(args.db or default_db_path())
    try:
        if args.action == "create":
            models = [m.strip() for m in args.models.split(",") if m.strip()] or None
            record, secret = store.create(
                args.kind,
                args.name,
                models=models,
                max_requests_per_minute=args.rpm,
                max_tokens_per_minute=args.tpm,
                max_concurrent=args.max_concurrent,
            )
            if args.json:
                print(json.dumps({"key_id": record.key_id, "kind": record.kind, "secret": secret}))
            else:
                print(f"key_id: {record.key_id}\nkind:   {record.kind}\nsecret: {secret}")
                print("Store the secret now: it is not kept and cannot be shown again.")
        elif args.action == "list":
            records = store.list()
            if args.json:
                print(json.dumps([_record_dict(r) for r in records]))
            elif not records:
                # On stderr: stdout stays the (empty) listing for scripts.
                print(f"no keys in {store.path}; create one with `tokios keys create --name NAME` "
                      "(add --kind connector for a connector token)", file=sys.stderr)
            for record in records if not args.json else ():
                fields = _record_dict(record)
                print(
                    f"{fields['key_id']}  {fields['kind']:<9}  {fields['status']:<7}  name={fields['name'] or '-'}"
                    f"  models={','.join(fields['models'] or ['*'])}  rpm={fields['rpm'] or '-'}"
                    f"  tpm={fields['tpm'] or '-'}  max_concurrent={fields['max_concurrent'] or '-'}"
                    f"  created={fields['created']}"
                )
        elif args.action == "revoke":
            if not store.revoke(args.key_id):
                raise NotFoundError(f"key_id {args.key_id!r} is not a live key in {store.path}", param="key_id")
            print(f"revoked {args.key_id}")
    finally:
        store.close()
    return 0


def _record_dict(record) -> dict:
    return {
        "key_id": record.key_id,
        "kind": record.kind,
        "name": record.name,
        "status": "revoked" if record.is_revoked else "active",
        "models": list(record.models) if record.models is not None else None,
        "rpm": record.max_requests_per_minute,
        "tpm": record.max_tokens_per_minute,
        "max_concurrent": record.max_concurrent,
        "created": datetime.datetime.fromtimestamp(record.created_at).isoformat(timespec="seconds"),
    }
