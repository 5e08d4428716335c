"""Who is asking: the tenant behind a request's API key, and what that tenant may do.

With one key (`--token`, or Jupyter's own login) there is one tenant, `OWNER`, with every right:
the server behaves as a single-user service. With `api_keys:` in the config, each key is a tenant
of its own: its Responses-API store, its streams, its prefix-cache entries and its metrics are
apart from every other tenant's, and it may send `priority: "batch"`, load, unload or keep models
(`keep_alive`), or go unshed only where its entry says so. `--token` stays the owner's key.
docs/operations.md, "Several clients", says what this guarantees and what it does not.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from ..api.errors import ApiError
from ..config import ApiKey, ConfigError

API_KEYS_KEY = "magnitude_api_keys"


@dataclass(frozen=True)
class Tenant:
    name: str
    batch: bool = True
    models: bool = True
    never_shed: bool = False
    scope: str | None = None  # what keeps its cache, store and streams apart; None for the owner

    @classmethod
    def of(cls, key: ApiKey) -> Tenant:
        return cls(key.name, key.batch, key.models, key.never_shed, scope=key.name)

    def refuse(self, what: str, param: str | None = None) -> ApiError:
        return ApiError(
            403,
            f"the API key of {self.name!r} may not {what} (api_keys in the server's config says what each may do)",
            type="permission_error",
            param=param,
            code="not_permitted",
        )


OWNER = Tenant("owner")


def tenant_for(given: str, keys: tuple[ApiKey, ...]) -> Tenant | None:
    """The tenant whose key is `given`, comparing every key in constant time; None if none is."""
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.key.encode()):
            found = key
    return Tenant.of(found) if found is not None else None


def check_owner_key_apart(token: str | None, keys: tuple[ApiKey, ...]) -> None:
    """Refuse, before serving, a tenant key equal to the owner's `--token`: whoever held it would be
    the owner, with every right, while the config says it is a tenant with fewer."""
    if token is None:
        return
    for key in keys:
        if hmac.compare_digest(token.encode(), key.key.encode()):
            raise ConfigError(
                f"api_keys: the key of {key.name!r} is the server's own --token (the owner's key, which has "
                "every right): give the tenant a key of its own"
            )
