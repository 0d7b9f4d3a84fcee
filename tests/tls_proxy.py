"""A TLS-terminating TCP proxy in front of the Temporal dev server, which has no TLS flags.

    python -m tests.tls_proxy --port P --upstream 127.0.0.1:7233 --cert S.pem --key S.key [--client-ca CA.pem]

Terminates TLS (ALPN h2, as gRPC expects) with the given server certificate and, with
``--client-ca``, requires a client certificate signed by that CA (mTLS); the decrypted
bytes go to the upstream unchanged. Prints ``READY <port>`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl

log = logging.getLogger("tls_proxy")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def serve(port: int, upstream: tuple[str, int], ctx: ssl.SSLContext) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError as err:
            log.warning("upstream %s:%d: %s", *upstream, err)
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port, ssl=ctx)
    print(f"READY {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="host:port of the plaintext server")
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tls_proxy %(levelname)s %(message)s")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.cert, args.key)
    ctx.set_alpn_protocols(["h2"])
    if args.client_ca:
        ctx.load_verify_locations(args.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    host, _, port = args.upstream.rpartition(":")
    asyncio.run(serve(args.port, (host, int(port)), ctx))


if __name__ == "__main__":
    main()
