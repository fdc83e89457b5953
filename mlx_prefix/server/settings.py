"""HTTP server settings: one frozen record, filled by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_prefix.config import FOREVER
from mlx_prefix.vision.intake import ImageLimits

from .guards.hosts import check_allowed_host
from .ollama_port import OLLAMA_ADDRESS, split_address


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    # Origins allowed besides the defaults (loopback pages, browser extensions):
    # exact origins such as "https://app.example.com", or "*" for any.
    allowed_origins: tuple[str, ...] = ()
    # Host header names accepted besides loopback names and the bound address (DNS
    # rebinding, server/guards/hosts.py): "llm.example.com", ".example.com" (with subdomains),
    # or "*" for any (behind a proxy that rewrites Host).
    allowed_hosts: tuple[str, ...] = ()
    api_key: str | None = None  # when set, /v1/* requires `Authorization: Bearer <key>`
    # A request body's bytes: images come base64 inside (a screenshot or two).
    max_body_bytes: int = 48 * 1024 * 1024
    log_level: str = "info"
    default_max_tokens: int = 512  # when a request names neither max_tokens form
    # Sampling defaults for requests that leave the field out (None: the API's own).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens_limit: int = 1_000_000  # hard cap when the model's context length is unknown
    shutdown_grace_s: float = 10.0  # in-flight requests get this long, then are cancelled
    warm_timeout_s: float = 600.0  # POST /v1/cache/warm answers 504 after this long
    # More names for the served model (--alias); see server/served/names.py.
    aliases: tuple[str, ...] = ()
    # An unknown model name is a 404 instead of being served by the default model.
    strict_model_names: bool = False
    # Several models (server/served/pool.py): how many engines stay resident at once
    # (LRU), and "NAME=PATH" names for other model folders or cached hub ids.
    max_models: int = 1
    model_aliases: tuple[str, ...] = ()
    # Idle unload (server/served/idle.py): seconds a model loaded on demand stays once
    # idle, and the same for the --model one (FOREVER: until a swap needs its room).
    keep_alive_s: float = 300.0
    model_keep_alive_s: float = FOREVER
    # Model folders, cached hub ids and LoRA adapter folders a request may name, loaded
    # on demand (besides the served model and the model_aliases); nothing else is.
    allowed_models: tuple[str, ...] = ()
    # Keep a system block shaped like Claude Code's `x-anthropic-billing-header: k=v;`
    # in the prompt (it changes between requests, so by default it is left out).
    keep_billing_header: bool = False
    # Images in requests (mlx_prefix/vision/intake.py, fetch.py): --allow-image-urls,
    # --image-max-bytes, --image-max-pixels, --max-images, --max-request-pixels (all a
    # request's images together, from their headers: four 4K screenshots).
    allow_image_urls: bool = False
    image_max_bytes: int = 20 * 1024 * 1024
    image_max_pixels: int = 32_000_000
    max_images: int = 32
    max_request_pixels: int = 4 * 3840 * 2160
    image_fetch_timeout_s: float = 10.0
    # Explain every request's reuse (explain/): GET /v1/cache/requests, the dashboard's
    # misses, per-reason metrics and log lines. Off: none of them (--no-explain).
    explain_requests: bool = True
    responses_store: int = 1000  # /v1/responses kept for previous_response_id (LRU); 0: none
    # ... and the bytes they may hold (text and encoded images, server/responses_store.py).
    responses_store_bytes: int = 256 * 1024 * 1024
    # Cache namespaces (server/guards/namespaces.py): "origin" keeps each Origin's (and API
    # key's) entries apart; "global" shares one cache among every client.
    cache_sharing: str = "origin"
    # /v1/embeddings (with --embedding-model): more names for the embedding model, and
    # OpenAI's bounds on one request (inputs, tokens over all inputs).
    embedding_aliases: tuple[str, ...] = ()
    embedding_max_inputs: int = 2048
    embedding_max_tokens: int = 300_000
    # Also listen on this address, Ollama's ("127.0.0.1:11434"; server/ollama_port.py).
    ollama: str | None = None

    @property
    def images(self) -> ImageLimits:
        return ImageLimits(
            max_bytes=self.image_max_bytes,
            max_pixels=self.image_max_pixels,
            max_images=self.max_images,
            max_request_pixels=self.max_request_pixels,
            allow_urls=self.allow_image_urls,
            fetch_timeout_s=self.image_fetch_timeout_s,
        )

    def __post_init__(self) -> None:
        origins = self.allowed_origins
        if isinstance(origins, str):  # "a,b" from an env var or a config file
            origins = tuple(o.strip() for o in origins.split(",") if o.strip())
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") for o in origins))
        hosts = self.allowed_hosts
        if isinstance(hosts, str):
            hosts = tuple(h.strip() for h in hosts.split(",") if h.strip())
        object.__setattr__(self, "allowed_hosts", tuple(check_allowed_host(h) for h in hosts))
        for name in ("aliases", "embedding_aliases"):
            names = getattr(self, name)
            if isinstance(names, str):
                names = tuple(a.strip() for a in names.split(",") if a.strip())
                object.__setattr__(self, name, names)
            if any(not a or a != a.strip() for a in names):
                raise ValueError(f"{name}: empty or padded names in {names!r}")
        if min(self.embedding_max_inputs, self.embedding_max_tokens) < 1:
            raise ValueError("embedding_max_inputs and embedding_max_tokens must be positive")
        if isinstance(self.model_aliases, str):
            pairs = tuple(a.strip() for a in self.model_aliases.split(",") if a.strip())
            object.__setattr__(self, "model_aliases", pairs)
        if isinstance(self.allowed_models, str):
            models = tuple(m.strip() for m in self.allowed_models.split(",") if m.strip())
            object.__setattr__(self, "allowed_models", models)
        self.model_alias_map()  # ValueError for a malformed pair
        if self.ollama == "":  # `--ollama` alone
            object.__setattr__(self, "ollama", OLLAMA_ADDRESS)
        if self.ollama is not None:
            split_address(self.ollama)  # ValueError for a malformed address
        if self.max_models < 1:
            raise ValueError("max_models must be at least 1")
        if min(self.keep_alive_s, self.model_keep_alive_s) < 0:
            raise ValueError("keep_alive_s and model_keep_alive_s must not be negative")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise ValueError(
                    f"allowed_origins: {origin!r} is not an origin such as "
                    "'https://app.example.com' (or '*')"
                )
        if self.cache_sharing not in ("origin", "global"):
            raise ValueError(f"cache_sharing must be origin or global, not {self.cache_sharing!r}")
        if min(self.max_images, self.max_request_pixels) < 0:
            raise ValueError("max_images and max_request_pixels must not be negative")
        if min(self.responses_store, self.responses_store_bytes) < 0:
            raise ValueError("responses_store and responses_store_bytes must not be negative")
        if min(self.max_body_bytes, self.default_max_tokens, self.max_tokens_limit) < 1:
            raise ValueError("max_body_bytes and the max_tokens settings must be positive")
        for name, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1), ("min_p", 0, 1)):
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                raise ValueError(f"{name} must be between {lo} and {hi}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError("top_k must be at least 0 (0: no limit)")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must not be negative")
        if not self.warm_timeout_s > 0:
            raise ValueError("warm_timeout_s must be positive")

    def model_alias_map(self) -> dict[str, str]:
        """--model-alias NAME=PATH pairs as {NAME: PATH}."""
        pairs = {}
        for item in self.model_aliases:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"model_aliases: {item!r} is not NAME=PATH")
            pairs[name.strip()] = path.strip()
        return pairs
