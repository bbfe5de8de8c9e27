"""CURVE keys for the router connection, in the files `llm keygen` and
`llm-cluster up` write (docs/security.md):

- a key pair file NAME.key: lines `public <z85>` and `secret <z85>`;
- a public key file NAME.pub: one line `<z85>`.

Keys are Z85 text, 40 characters.  '#' starts a comment where a word
starts (a key never starts with it); blank lines are ignored.  Errors name
the file and line, as the C programs' do.

The settings come from the arguments, else from the environment that `llm`
and libllmclient read: LLM_CURVE_KEY_FILE, LLM_ROUTER_KEY, LLM_INSECURE (so
that a sourced RUN_DIR/env.sh of llm-cluster is enough)."""

import dataclasses
import os
import stat
import warnings
from typing import Optional

import zmq
from zmq.utils import z85

Z85_LEN = 40


class KeyFileError(ValueError):
    """A key file that cannot be read or holds no valid key."""


def _words(line):
    out = []
    for w in line.split():
        if w.startswith("#"):
            break
        out.append(w)
    return out


def _read_lines(path):
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        raise KeyFileError(f"{path}: {e.strerror}") from None


def _take(path, line, what, word):
    if len(word) != Z85_LEN:
        raise KeyFileError(f"{path}:{line}: {what} '{word[:60]}' is not a key (40 Z85 characters)")
    try:
        z85.decode(word.encode("ascii"))
    except Exception:
        raise KeyFileError(f"{path}:{line}: {what} '{word[:60]}' is not a key (40 Z85 characters)") from None
    return word.encode("ascii")


def load_key_pair(path):
    """(public, secret) of a NAME.key file, each as Z85 bytes."""
    pub = sec = None
    lines = _read_lines(path)
    try:
        if os.stat(path).st_mode & stat.S_IROTH:
            warnings.warn(f"{path}: holds a secret key and is readable by every user: keep its folder private, "
                          "or chmod 600 it", stacklevel=3)
    except OSError:
        pass
    for i, text in enumerate(lines, 1):
        w = _words(text)
        if not w:
            continue
        if len(w) != 2 or w[0] not in ("public", "secret"):
            raise KeyFileError(f"{path}:{i}: expected 'public <key>' or 'secret <key>', got "
                               f"'{w[0][:60]}{' ...' if len(w) > 1 else ''}'")
        if w[0] == "public":
            pub = _take(path, i, "public key", w[1])
        else:
            sec = _take(path, i, "secret key", w[1])
    if pub is None or sec is None:
        raise KeyFileError(f"{path}: no '{'secret' if pub else 'public'} <key>' line (a key pair file has "
                           "'public' and 'secret'; write one with llm keygen)")
    if zmq.curve_public(sec) != pub:
        raise KeyFileError(f"{path}: the public key {pub.decode()} does not belong to the secret key")
    return pub, sec


def load_public_key(path):
    """The key of a NAME.pub file, as Z85 bytes."""
    key = None
    for i, text in enumerate(_read_lines(path), 1):
        w = _words(text)
        if not w:
            continue
        if key is not None or len(w) != 1:
            raise KeyFileError(f"{path}:{i}: a public key file holds one key on one line")
        key = _take(path, i, "public key", w[0])
    if key is None:
        raise KeyFileError(f"{path}: no key in the file")
    return key


@dataclasses.dataclass
class Curve:
    """The CURVE settings of a client socket (Z85 bytes), or None for a
    plain one (insecure)."""
    publickey: bytes
    secretkey: bytes
    serverkey: bytes

    def apply(self, sock):
        sock.curve_secretkey = self.secretkey
        sock.curve_publickey = self.publickey
        sock.curve_serverkey = self.serverkey


def _truthy(v):
    return v is not None and v.strip().lower() in ("true", "1", "yes", "on")


def curve_settings(curve_key_file=None, router_key=None, insecure=None, curve_secretkey=None,
                   curve_publickey=None, curve_serverkey=None) -> Optional[Curve]:
    """The CURVE settings of a client: the keys given (as Z85 text or bytes),
    else the files given, else LLM_CURVE_KEY_FILE and LLM_ROUTER_KEY, the
    way libllmclient chooses (docs/client.md); None when insecure (the
    argument, or LLM_INSECURE=true when no key is given).  Raises
    KeyFileError for a bad file and ValueError when there are no keys and
    not insecure, naming the options."""
    def b(v):
        return v.encode("ascii") if isinstance(v, str) else v

    if curve_secretkey is not None:
        sec = b(curve_secretkey)
        pub = b(curve_publickey) if curve_publickey is not None else zmq.curve_public(sec)
        server = b(curve_serverkey) if curve_serverkey is not None else None
        if server is None:
            rk = router_key or os.environ.get("LLM_ROUTER_KEY")
            if not rk:
                raise ValueError("curve_secretkey without the router's key: give curve_serverkey or router_key "
                                 "(LLM_ROUTER_KEY)")
            server = load_public_key(rk)
        for name, v in (("curve_secretkey", sec), ("curve_publickey", pub), ("curve_serverkey", server)):
            _take(name, 1, "key", v.decode("ascii", "replace"))
        if zmq.curve_public(sec) != pub:
            raise ValueError(f"curve_publickey {pub.decode()} does not belong to curve_secretkey")
        return Curve(pub, sec, server)
    key, router = curve_key_file, router_key
    if not key and not insecure:
        key = os.environ.get("LLM_CURVE_KEY_FILE")
        router = router or os.environ.get("LLM_ROUTER_KEY")
        insecure = _truthy(os.environ.get("LLM_INSECURE"))
    if insecure:
        return None
    if not key or not router:
        raise ValueError(f"llmcluster: no {'router key' if key else 'key pair'}: give curve_key_file "
                         "(LLM_CURVE_KEY_FILE) and router_key (LLM_ROUTER_KEY), or insecure=True "
                         "(LLM_INSECURE=true) for a router without keys")
    if not zmq.has("curve"):
        raise ValueError("llmcluster: this libzmq has no CURVE support (pyzmq's zmq.has('curve') is False)")
    pub, sec = load_key_pair(key)
    return Curve(pub, sec, load_public_key(router))


def default_endpoint():
    """LLM_ROUTER's first endpoint, else the router's default address."""
    ep = os.environ.get("LLM_ROUTER", "").split(",")[0].strip()
    return ep or "tcp://127.0.0.1:5555"
