"""Transport: messages, their codec, and the ZeroMQ channels and control bus between stages.

``import transport`` stays light (numpy, msgpack, pyzmq, structlog): torch is imported only
when a torch frame is decoded, and never to encode (a tensor exists only if torch is loaded).
"""

from transport.address import check_address, ipc_address, tcp_address
from transport.codec import decode, encode
from transport.control import ControlBroker, ControlClient
from transport.errors import ChannelClosed, DecodeError, EndOfStream, TransportError
from transport.message import Message, Schema
from transport.receiver import Receiver
from transport.sender import Sender

__all__ = [
    "ChannelClosed",
    "ControlBroker",
    "ControlClient",
    "DecodeError",
    "EndOfStream",
    "Message",
    "Receiver",
    "Schema",
    "Sender",
    "TransportError",
    "check_address",
    "decode",
    "encode",
    "ipc_address",
    "tcp_address",
]
