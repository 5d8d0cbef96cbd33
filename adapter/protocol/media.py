"""Multimodal ``inputs`` elements (spec §3.4): structure, sources and security rules.

Everything about media lives here so that a multimodal model can reuse it. This
module never downloads anything: it validates what it can without I/O beyond a
DNS lookup (injectable) and a ``stat`` of local files, and returns
:class:`MediaItem` records (with the validated IP address for URLs, so that a
future downloader connects to exactly that address, without resolving again).

Text-only models (spec §3.4, "Text-only models"): the array form is validated in
full, then only the first element's text is used; it must be a text element.
Other elements, media included, are ignored, as MindIE's base tokenizer does.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from adapter.errors import validation_error

TEXT_KEY = "text"
MEDIA_KEYS = ("image_url", "video_url", "audio_url")
MAX_MEDIA_ITEMS = 20
MAX_URL_LENGTH = 4096
ALLOWED_MEDIA_DOMAINS_ENV = "ALLOWED_MEDIA_DOMAINS_ENV"
LOCAL_MEDIA_ROOT = "/data/multimodal_inputs/"
LOCAL_MAX_MODE = 0o640
MIB = 1024 * 1024
SIZE_LIMITS = {"image_url": 40 * MIB, "video_url": 512 * MIB, "audio_url": 40 * MIB}  # D24
TOTAL_SIZE_LIMIT = 1000 * MIB
EXTENSIONS = {
    "image_url": (".jpg", ".jpeg", ".png"),
    "video_url": (".mp4", ".avi", ".wmv"),
    "audio_url": (".mp3", ".wav", ".flac"),
}
MIME_TYPES = {  # MIME type -> file extension, per media kind
    "image_url": {"image/jpeg": ".jpg", "image/png": ".png"},
    "video_url": {"video/mp4": ".mp4", "video/x-msvideo": ".avi", "video/x-ms-wmv": ".wmv"},
    "audio_url": {"audio/mpeg": ".mp3", "audio/x-wav": ".wav", "audio/flac": ".flac"},
}
WILDCARD_DNS_SUFFIXES = ("nip.io", "sslip.io", "xip.io")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_CHARS = re.compile(r"[A-Za-z0-9_\-./]+")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_DATA_URI = re.compile(r"data:([^;,]*);base64,(.*)", re.S | re.I)
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")

Resolver = Callable[[str], Iterable[str]]


def system_resolver(host: str) -> list[str]:
    """All addresses ``host`` resolves to (the default resolver)."""
    return [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]


# Tests (or a deployment) may replace this; a ``resolver`` argument wins over it.
DEFAULT_RESOLVER: Resolver = system_resolver


@dataclass(frozen=True)
class MediaItem:
    kind: str  # image_url / video_url / audio_url
    source: str  # "url", "local" or "base64"
    location: str  # the URL, the resolved local path, or "" for base64
    address: str | None = None  # URL: the validated IP address to connect to
    size: int | None = None  # bytes, when known without downloading
    extension: str = ""


@dataclass(frozen=True)
class InputElement:
    type: str  # "text" or one of MEDIA_KEYS
    text: str | None = None
    media: MediaItem | None = None


def check_structure(items: list) -> None:
    """The endpoint's shape check (before L1): text type, null media, at most 20 media."""
    count = 0
    for item in items:
        if not isinstance(item, dict):
            continue
        if TEXT_KEY in item and not isinstance(item[TEXT_KEY], str):
            raise validation_error("Request param text must be string")
        if not any(key in item for key in MEDIA_KEYS):
            continue
        for key in MEDIA_KEYS:
            if key in item and item[key] is None:
                raise validation_error(f"Request param {key} null")
        count += 1
        if count > MAX_MEDIA_ITEMS:
            raise validation_error(f"The number of multimodal url should be no more than {MAX_MEDIA_ITEMS}")


def validate_elements(
    items: list,
    *,
    resolver: Resolver | None = None,
    allowed_domains: Iterable[str] | None = None,
    local_root: str = LOCAL_MEDIA_ROOT,
) -> list[InputElement]:
    """Validate every element and its media source; raises 422 on the first failure.

    ``allowed_domains`` defaults to ``$ALLOWED_MEDIA_DOMAINS_ENV`` read at call time.
    """
    domains = (
        load_allowed_domains() if allowed_domains is None else {d.strip().lower() for d in allowed_domains}
    )
    elements: list[InputElement] = []
    total = 0
    for item in items:
        element = _validate_element(item, resolver or DEFAULT_RESOLVER, domains, local_root)
        if element.media is not None and element.media.size:
            total += element.media.size
            if total > TOTAL_SIZE_LIMIT:
                raise validation_error(f"The total media input cannot exceed {TOTAL_SIZE_LIMIT / MIB} MB.")
        elements.append(element)
    return elements


def text_for_text_only_model(elements: list[InputElement]) -> str:
    """The first element's text; it must be a text element (spec §3.4). The others are ignored."""
    first = elements[0]
    if first.type != TEXT_KEY or first.text is None:
        raise validation_error(
            f"The first element of inputs must be a text element for a text-only model, got {first.type}"
        )
    return first.text


def load_allowed_domains() -> set[str]:
    """``$ALLOWED_MEDIA_DOMAINS_ENV``: comma-separated, trimmed, case-insensitive hostnames."""
    raw = os.environ.get(ALLOWED_MEDIA_DOMAINS_ENV, "")
    return {d.strip().lower().rstrip(".") for d in raw.split(",") if d.strip()}


def is_blocked_address(address: str) -> bool:
    """True for any address a media URL must not reach (spec §3.4, SSRF)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    return _blocked(ip)


def _blocked(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour]
        if ip.teredo:
            embedded.extend(ip.teredo)
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(e is not None and _blocked(e) for e in embedded):
            return True
    elif ip in _CGNAT:
        return True
    return (
        not ip.is_global
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def is_wildcard_dns(host: str) -> bool:
    host = host.lower().rstrip(".")
    return any(host == s or host.endswith("." + s) for s in WILDCARD_DNS_SUFFIXES)


# --------------------------------------------------------------------------- elements


def _element_type(item: dict) -> str:
    kind = item.get("type")
    if kind is None:  # D20: infer it from the single recognised key
        keys = [k for k in (TEXT_KEY, *MEDIA_KEYS) if k in item]
        if len(keys) != 1:
            raise validation_error(
                "Cannot infer the type of an inputs element: give 'type' or exactly one of "
                "text, image_url, video_url, audio_url"
            )
        return keys[0]
    if kind != TEXT_KEY and kind not in MEDIA_KEYS:
        raise validation_error(f"Input type {kind} does not match the mm type.")
    return kind


def _validate_element(item: object, resolver: Resolver, domains: set[str], local_root: str) -> InputElement:
    if not isinstance(item, dict):
        name = {list: "list", str: "str", int: "int", float: "float", bool: "bool"}.get(
            type(item), "NoneType"
        )
        raise validation_error(f"The input type of '{name}' is invalid, it should be a List[Dict].")
    kind = _element_type(item)
    value = item.get(kind)
    if kind == TEXT_KEY:
        if not isinstance(value, str):
            raise validation_error("Request param text must be string")
        if not value:
            raise validation_error("Request param text must be not empty")
        return InputElement(TEXT_KEY, text=value)
    if value is None:
        raise validation_error(f"Request param {kind} null")
    if isinstance(value, dict):
        value = value.get("url")  # "detail" other than auto is ignored
        if not isinstance(value, str):
            raise validation_error(f"Request param {kind}.url must be string")
    elif not isinstance(value, str):
        raise validation_error(f"Input of {kind} should be str or dict.")
    if not value:
        raise validation_error(f"Request param {kind} must be not empty")
    return InputElement(kind, media=_validate_source(kind, value, resolver, domains, local_root))


def _validate_source(kind: str, value: str, resolver: Resolver, domains: set[str], root: str) -> MediaItem:
    scheme_match = _SCHEME.match(value)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme == "data":
        return _validate_data_uri(kind, value)
    if scheme in ("http", "https"):
        return _validate_url(kind, value, resolver, domains)
    if scheme == "file":
        if not value.lower().startswith("file://"):
            raise validation_error(f"Invalid URL: {value}")
        return _validate_local(kind, value[len("file://") :], root)
    if scheme:
        raise validation_error(
            f"Unsupported scheme '{scheme}' in {kind}: only http, https, file and data are allowed"
        )
    if os.path.splitext(value)[1].lower() in EXTENSIONS[kind]:
        return _validate_local(kind, value, root)
    if kind == "image_url" and "." not in value:  # bare base64 is JPEG (image only)
        size = _decode_base64(kind, value)
        return MediaItem(kind, "base64", "", size=size, extension=".jpg")
    raise _extension_error(kind)


def _extension_error(kind: str):
    return validation_error(f"{kind} url must end with one of {list(EXTENSIONS[kind])}.")


def _validate_url(kind: str, url: str, resolver: Resolver, domains: set[str]) -> MediaItem:
    if len(url) > MAX_URL_LENGTH:
        raise validation_error(
            f"The length of media_url should be less than {MAX_URL_LENGTH}, but got {len(url)}."
        )
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".")
        _ = parts.port  # raises on a malformed port
    except ValueError:
        raise validation_error(f"Invalid URL: {url}") from None
    if not host:
        raise validation_error(f"Invalid URL: {url}")
    if not domains:  # D21: no whitelist, no URL media
        raise validation_error(
            f"The media URL domain is not allowed: {ALLOWED_MEDIA_DOMAINS_ENV} is not set, so URL media are disabled"
        )
    if host not in domains:
        raise validation_error(
            f"The media URL domain is not allowed: Domain '{host}' is not in allowed domain list"
        )
    if is_wildcard_dns(host):
        raise validation_error(f"The media URL domain is not allowed: '{host}' is a wildcard DNS domain")
    extension = os.path.splitext(parts.path)[1].lower()
    if extension not in EXTENSIONS[kind]:
        raise _extension_error(kind)
    return MediaItem(kind, "url", url, address=_resolve_safely(host, resolver), extension=extension)


def _resolve_safely(host: str, resolver: Resolver) -> str:
    try:
        ipaddress.ip_address(host)
        addresses = [host]
    except ValueError:
        try:
            addresses = [str(a) for a in resolver(host)]
        except (OSError, UnicodeError, ValueError):
            addresses = []
    if not addresses:
        raise validation_error(f"The media URL host '{host}' cannot be resolved")
    for address in addresses:
        if is_blocked_address(address):
            raise validation_error(f"The media URL host '{host}' resolves to a disallowed address {address}")
    return addresses[0].split("%", 1)[0]


def _validate_local(kind: str, path: str, root: str) -> MediaItem:
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise validation_error(
            f"Your input local file path is not allowed! please ensure your multimedia files are placed under {root}"
        )
    if not os.path.isfile(real):
        raise validation_error("Can not find the input media file.")
    if not _LOCAL_CHARS.fullmatch(path) or not _LOCAL_CHARS.fullmatch(real):
        raise validation_error("The media url contains dangerous characters, only allow a-zA-Z0-9_-./")
    stat = os.stat(real)
    mode = stat.st_mode & 0o777
    if mode & ~LOCAL_MAX_MODE:
        raise validation_error(
            f"The permission of the input media file must be no broader than {oct(LOCAL_MAX_MODE)}, got {oct(mode)}"
        )
    extension = os.path.splitext(real)[1].lower()
    if extension not in EXTENSIONS[kind]:
        raise _extension_error(kind)
    _check_size(kind, stat.st_size)
    return MediaItem(kind, "local", real, size=stat.st_size, extension=extension)


def _validate_data_uri(kind: str, uri: str) -> MediaItem:
    match = _DATA_URI.fullmatch(uri)
    if not match:
        raise validation_error("Expected format: data:<mime_type>/<subtype>;base64,<base64_data>")
    mime = match.group(1).strip().lower()
    if mime not in MIME_TYPES[kind]:
        raise validation_error(
            f"The MIME type '{mime}' is not allowed for {kind}, expected one of {list(MIME_TYPES[kind])}"
        )
    size = _decode_base64(kind, match.group(2))
    return MediaItem(kind, "base64", "", size=size, extension=MIME_TYPES[kind][mime])


def _decode_base64(kind: str, data: str) -> int:
    """Strict base64; returns the decoded size after the size and (image) content checks."""
    _check_size(kind, len(data) // 4 * 3 - data.count("=", -2))
    try:
        content = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise validation_error(f"The base64 data of {kind} is invalid") from None
    if not content:
        raise validation_error(f"The base64 data of {kind} is invalid")
    if kind == "image_url" and not content.startswith(_IMAGE_MAGIC):
        raise validation_error("The image_url data is not a valid JPEG or PNG image")
    return len(content)


def _check_size(kind: str, size: int) -> None:
    if size > SIZE_LIMITS[kind]:
        raise validation_error(f"The size of {kind} cannot exceed {SIZE_LIMITS[kind] / MIB} MB")
