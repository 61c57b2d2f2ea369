//! A guide: from opening a device to an RDMA WRITE application, then the
//! errors newcomers meet and what to do about each.
//!
//! (This module has no items; it is documentation.)
//!
//! Each type is named by its module (`rdma_verbs::qp::Qp`, `rdma_verbs::cq::Cq`);
//! [`prelude`](crate::prelude) brings in the ones most programs name, and the
//! snippets below assume `use rdma_verbs::prelude::*;`.
//!
//! # 1. A device
//! [`Context::open(None)`](crate::context::Context::open) opens the first RDMA device
//! (`Some("rxe0")` a named one); [`devices`](crate::device::devices) lists them.
//! Without RDMA hardware, soft-RoCE works: `rdma link add rxe0 type rxe
//! netdev eth0` on a kernel with `rdma_rxe`, or the project's soft-RoCE VM
//! runner (README, "Testing your own crate without RDMA hardware").
//! [`Context::query_port`](crate::context::Context::query_port) tells the link layer:
//! InfiniBand, or Ethernet (RoCE), which needs a GID on every connection.
//!
//! # 2. Memory
//! The NIC reads and writes only registered memory:
//! [`Pd::alloc_mr(len, access)`](crate::pd::Pd::alloc_mr) allocates and registers.
//! `access` says what the NIC may do: `LOCAL_WRITE` for anything the NIC
//! writes locally (receive buffers, READ and atomic destinations), and
//! `REMOTE_WRITE` / `REMOTE_READ` / `REMOTE_ATOMIC` for what the *peer* may do
//! to it (the remote flags that write need `LOCAL_WRITE` too). An `Mr` is
//! exclusively owned; [`Mr::freeze`](crate::mr::Mr::freeze) turns it into a
//! cloneable read-only [`SharedMr`](crate::mr::SharedMr) for sources posted many
//! times. Memory a peer may write is never handed out as a slice: copy with
//! [`Mr::read_at`](crate::mr::Mr::read_at) / [`Mr::to_vec`](crate::mr::Mr::to_vec).
//! [`Mr::remote`](crate::mr::Mr::remote) is what a peer needs to reach it
//! (address, length, rkey).
//!
//! Data you already hold need not be copied in:
//! [`Mr::register(pd, buf, access)`](crate::mr::Mr::register) registers a
//! `Vec<u8>`, a `Box<[u8]>`, an [`AnonMemory`](crate::mr::AnonMemory) or
//! (feature `memmap2`) a memory-mapped file in place, and
//! [`Mr::into_buffer`](crate::mr::Mr::into_buffer) gives it back with what the
//! NIC wrote. [`Mr::new_huge`](crate::mr::Mr::new_huge) puts a registration on
//! 2 MiB or 1 GiB huge pages; its error says how to reserve them.
//! `examples/file_read.rs` serves a memory-mapped file for remote READ this
//! way (and why its mapping is private on kernels before 6.2).
//! [`MrPool`](crate::mr::MrPool) hands out fixed-size buffers of one
//! registration, so the data path never registers; with the `bytes` feature,
//! `MrPool::to_bytes` hands a received buffer
//! on as `bytes::Bytes` without a copy, back in the pool when the last clone
//! drops (for pools no peer can write). For memory a C library
//! hands out again and again, [`RegCache`](crate::mr::RegCache) registers
//! each (address, length, access) once and serves repeats from a hash map
//! until you invalidate the range. On-demand paging
//! ([`AccessFlags::ON_DEMAND`](crate::mr::AccessFlags::ON_DEMAND),
//! [`Mr::prefetch`](crate::mr::Mr::prefetch)) is refused with
//! `Error::Unsupported` on devices without it, rxe included.
//!
//! To grant a peer part of a region for a while and take it back, use a
//! memory window ([`mw`](crate::mw)): register the region with `LOCAL_WRITE |
//! MW_BIND` and no remote rights, allocate an [`Mw`](crate::mw::Mw), bind it
//! with [`Qp::post_bind_mw`](crate::qp::Qp::post_bind_mw) (a range and its
//! rights), send the returned `RemoteMr` once the bind's completion arrived,
//! and revoke it with [`Qp::post_local_inv`](crate::qp::Qp::post_local_inv):
//! the peer's next access fails with `REM_ACCESS_ERR`.
//! `examples/mw_grant.rs` walks through every step across two processes.
//!
//! # 3. Queues
//! A [`Cq`](crate::cq::Cq) collects completions; a [`Qp`](crate::qp::Qp) has a send
//! and a receive queue. Each queue needs as many CQ entries as its depth
//! (`max_send_wr`, `max_recv_wr`): a QP created on a CQ too small for its
//! queues grows the CQ ([`Cq::resize`](crate::cq::Cq::resize)), so any size
//! works to start with; only a CQ that cannot grow (past the device's
//! `max_cqe`, or after [`set_auto_grow(false)`](crate::cq::Cq::set_auto_grow))
//! makes [`Qp::new`](crate::qp::Qp::new) refuse with
//! [`Error::CqTooSmall`](crate::Error::CqTooSmall).
//! A QP goes RESET → [`init`](crate::qp::Qp::init) → [`rtr`](crate::qp::Qp::rtr) →
//! [`rts`](crate::qp::Qp::rts); receives may be posted from INIT on, sends only
//! in RTS, and the compiler enforces both, as it does that `to_error` is not
//! called in RESET (the kernel refuses it). A shared receive queue
//! ([`Srq`](crate::srq::Srq)) is topped up with `refill`, or with `try_refill`
//! when the buffers come from an allocator that can fail.
//!
//! # 4. Connecting
//! Each side needs the other's [`Endpoint`](crate::qp::Endpoint) (LID, QP number,
//! PSN, GID), exchanged out of band. [`exchange::connect_client`](crate::exchange::connect_client)
//! and [`exchange::serve`](crate::exchange::serve) do it over TCP and bring
//! the QP to RTS (the server before it answers), also handing over the
//! regions each side advertises. With `gid_index` `None` they pick
//! [`Context::default_gid_index`](crate::context::Context::default_gid_index): the
//! RoCE v2 GID of the interface's IPv4 address on RoCE, none on InfiniBand.
//! The crate docs have a complete two-process program; `examples/rdma_write.rs`
//! is a longer one. With rdma_cm (IP addresses and ports, the `cm` module), a
//! tokio server accepts with
//! [`AsyncCmId::accept`](crate::tokio::AsyncCmId::accept); the blocking
//! [`ConnectRequest::accept`](crate::cm::ConnectRequest::accept) is for
//! threads.
//!
//! On an iWARP device (soft-iWARP `siw`, iWARP RNICs) connect through rdma_cm only: QPs
//! are RC only and carry no immediate data, atomics or memory windows. The crate refuses
//! the rest with [`Error::Unsupported`](crate::error::Error::Unsupported) naming what
//! iWARP lacks: UD and UC QPs at creation, a hand-made RTR, and such a request once the
//! provider has refused its post (its buffers come back in the
//! [`PostError`](crate::qp::PostError); the QP stays usable).
//!
//! UD has no connection: each send names an
//! [`AddressHandle`](crate::ah::AddressHandle).
//! [`AddressHandle::for_endpoint(&qp, &peer, None)`](crate::ah::AddressHandle::for_endpoint)
//! builds it from the peer's `Endpoint` in one call (the QP's port and PD, the
//! default GID index); [`Qp::address_vector`](crate::qp::Qp::address_vector)
//! gives the address to adjust (SL, hop limit) before
//! [`AddressHandle::new`](crate::ah::AddressHandle::new).
//!
//! rdma_cm does UD too, as `udaddy` does: the client's
//! [`CmId::new_ud`](crate::cm::CmId::new_ud), `resolve`,
//! [`create_ud_qp`](crate::cm::CmId::create_ud_qp) (a `Qp<Ud, Rts>` at once),
//! receives posted, then [`connect_ud`](crate::cm::CmId::connect_ud) asks the
//! listener ([`CmId::ud_listener`](crate::cm::CmId::ud_listener)) for its QP
//! and returns it as a [`UdPeer`](crate::cm::UdPeer) to send to
//! (`qp.post_send(peer.send_from(1, buf))`). The server answers each request
//! with [`accept_ud`](crate::cm::ConnectRequest::accept_ud) (no wait), and each
//! client's first datagram with
//! [`UdPeer::reply_to(&qp, &completion, &msg)`](crate::cm::UdPeer::reply_to):
//! the request does not name the client's QP. Nobody listening is
//! [`Error::CmEvent`](crate::error::Error::CmEvent) with UNREACHABLE and status 1.
//!
//! Multicast, as `mckey` does (`examples/mcast.rs` takes its flags): a UD id
//! resolves the group's address from a local one
//! (`id.resolve_addr(Some(local), group, t)`), creates its QP, posts receives,
//! and [`join_multicast(&qp, group, t)`](crate::cm::CmId::join_multicast) waits
//! for MULTICAST_JOIN, attaches the QP and returns the group as a `UdPeer`
//! (remote QPN [`MULTICAST_QPN`](crate::qp::MULTICAST_QPN), the group's Q_Key):
//! every member's QP receives what is sent to it.
//! [`leave_multicast`](crate::cm::CmId::leave_multicast)
//! detaches and leaves. Without rdma_cm,
//! [`Qp::attach_mcast(gid, lid)`](crate::qp::Qp::attach_mcast) attaches a UD QP
//! to a group GID directly; the QP keeps its groups and detaches them when
//! dropped (the kernel would not destroy it otherwise). On RoCE the attach
//! does not join the IP group (IGMP): rdma_cm's join does.
//!
//! A server of many clients accepts them concurrently:
//! [`ExchangeListener::serve_each`](crate::exchange::ExchangeListener::serve_each)
//! runs each client's exchange ([`ExchangeStream::serve`](crate::exchange::ExchangeStream::serve))
//! on a thread of its own, and
//! [`incoming`](crate::exchange::ExchangeListener::incoming) hands out
//! connections as `std::net::TcpListener::incoming` does; under `tokio`,
//! [`tokio::exchange::ExchangeListener`](crate::tokio::exchange::ExchangeListener)
//! serves a client per task. A client that stalls fails its own exchange at the
//! message limit, not the others'. Keep the connection (the `_kept` forms,
//! or the one `serve` ran on) and call
//! [`ready`](crate::exchange::ExchangeStream::ready) once the receives are
//! posted; the peer calls [`wait_ready`](crate::exchange::ExchangeStream::wait_ready)
//! before its first SEND (or both call
//! [`barrier`](crate::exchange::ExchangeStream::barrier)). A peer gone
//! meanwhile is [`Error::PeerClosed`](crate::error::Error::PeerClosed).
//!
//! # 5. Posting and polling
//! Posting *moves* buffers into the QP; polling gives them back:
//!
//! ```no_run
//! # use rdma_verbs::prelude::*;
//! # fn f(qp: &mut Qp<Rc, Rts>, cq: &mut Cq, pd: &Pd, peer: RemoteMr) -> Result<()> {
//! let mut src = pd.alloc_mr(4096, AccessFlags::empty())?;
//! src.fill(7)?;
//! qp.post_send(SendWr::write_from(1, src, peer, 0))?; // `src` now belongs to the QP
//! let mut c = cq.poll_one(std::time::Duration::from_secs(5))?;
//! c.result()?; // a failed completion becomes an Error with a hint
//! let src = c.take_mr(); // and the buffer is back
//! # Ok(()) }
//! ```
//!
//! To send part of a buffer, post a range of it:
//! `SendWr::send_from(id, mr.range(..n)?)` sends the first `n` bytes (also
//! `write_from`, UD and UC sends, `sge`, and a READ's destination:
//! `SendWr::read(id, mr.range(..n)?, peer, 0)` reads `n` bytes); the completion gives back the
//! whole `Mr` (`take_mr`), and `..0` is a zero-byte SEND. A range outside the
//! `Mr` is refused with [`RangeError`](crate::qp::RangeError), which hands the
//! `Mr` back.
//!
//! Unsignaled requests (`.signaled(false)`) produce no completion of their
//! own; a later completion retires them. For a stream of small messages,
//! signal every Nth and poll in batches ([`Cq::poll`](crate::cq::Cq::poll) into a
//! `Vec` whose capacity is the batch).
//!
//! Moving buffers costs a little per request. For tight loops,
//! [`Cq::scope`](crate::cq::Cq::scope) lends them instead, like
//! `std::thread::scope`: requests borrow [`Src`](crate::qp::scope::Src) and
//! [`Dst`](crate::qp::scope::Dst) for the whole scope, which waits for them at its end,
//! and [`ScopedQp::buffers`](crate::qp::scope::ScopedQp::buffers) carves a region into
//! buffers lent one request at a time, to read what arrived and write what
//! to send without leaving the scope (the `qp::scope` module docs); a receiver
//! re-posts the buffers of a poll's completions with one verb call through
//! [`ScopedBuffers::post_recv_list`](crate::qp::scope::ScopedBuffers::post_recv_list). A scoped
//! receiver that must have its receives posted before the peer sends hands the
//! QP to [`Cq::scope_adopt`](crate::cq::Cq::scope_adopt) in INIT, posts, connects
//! inside the scope ([`AdoptedQp::connect`](crate::qp::scope::AdoptedQp::connect))
//! and gets it back in RTS.
//!
//! To send on one thread and receive on another, split the QP like a socket:
//! [`Qp::split`](crate::qp::Qp::split) gives a
//! [`SendHalf`](crate::qp::SendHalf) and a [`RecvHalf`](crate::qp::RecvHalf) that
//! post at the same time without a lock (move them into `std::thread::scope`
//! threads), or by value with [`Qp::into_split`](crate::qp::Qp::into_split) for
//! spawned threads and tasks (`reunite` puts it back together); give each queue
//! its own CQ so each thread polls its own.
//!
//! # 6. Troubleshooting
//! What the crate prints, and what to do. These are the errors' `Display`
//! texts (`{e}`), which their `Debug` form repeats, so a `main` that returns
//! `Result` prints them too.
//!
//! **No RDMA at all.** `this kernel has no RDMA support (no ib_uverbs; ...)`:
//! the kernel lacks the verbs modules (many cloud and CI kernels); use a
//! machine that has them, or the soft-RoCE VM runner.
//! `no RDMA devices found; create a soft-RoCE device with rdma link add rxe0
//! type rxe netdev <if>`: the modules are there but no device is; do that.
//!
//! **Memlock.** `ibv_reg_mr of N bytes failed: Cannot allocate memory (os
//! error 12); the locked-memory limit (RLIMIT_MEMLOCK) is 8388608 bytes (8192
//! KiB), raise it with ulimit -l unlimited (...)`: registration pins memory
//! and counts against that limit (root with CAP_IPC_LOCK is exempt). Raise it
//! for the user, the systemd unit (`LimitMEMLOCK=`) or the container
//! (`--ulimit memlock=-1`), or register less (reuse buffers: registration is
//! also slow, about 2–3 µs per page).
//!
//! **GID and RoCE.** `address vector: RoCE (an Ethernet port) needs a
//! GRH: give a GID index ...`: on Ethernet every address needs a GRH; pass a
//! GID index, or `None` to the helpers so that the default is used.
//! `gid index: port 1 of rxe0 has no GID at index 200; valid: 0
//! (fe80::..., RoCE v2), 1 (::ffff:10.99.0.1, RoCE v2)`: pick one of those;
//! both sides must use GIDs of the same type (RoCE v2 IPv4-mapped ones across
//! an IP network). `... is RoCE but has no GID: give its network interface an
//! IP address`: RoCE GIDs are the interface's addresses.
//!
//! **MTU.** `modify_qp INIT -> RTR failed: Invalid argument (os error 22)
//! (attr_mask ...); hint: check the remote QPN, the GID index ..., the path
//! MTU (at most the port's active_mtu) ...`: the path MTU must not exceed
//! either port's `active_mtu` ([`Qp::connect`](crate::qp::Qp::connect) uses the
//! local one; the peers must agree).
//!
//! **RNR.** `work request N completed with IBV_WC_RNR_RETRY_EXC_ERR ...;
//! hint: the peer had no receive posted ...`: a SEND arrived when the peer
//! had no receive buffer. Post receives before the sender starts (pre-post a
//! few hundred for streams) and raise `rnr_retry` ([`RtsAttr`](crate::qp::RtsAttr))
//! if the receiver can fall behind.
//!
//! **Retry exceeded.** `work request N completed with IBV_WC_RETRY_EXC_ERR
//! ...; hint: the peer did not answer ...`: the peer's QP is gone, not in
//! RTR/RTS, or unreachable (wrong GID, link down). With `retry_cnt` 7 some
//! providers (rxe among them) retry forever, so a dead peer is never reported:
//! use a smaller `retry_cnt` to bound the time.
//!
//! **Buffer too small.** The receiver sees `IBV_WC_LOC_LEN_ERR` (rxe:
//! `IBV_WC_LOC_QP_OP_ERR`), the sender `IBV_WC_REM_OP_ERR`: the incoming
//! message is larger than the receive buffer.
//!
//! **Access.** `IBV_WC_REM_ACCESS_ERR`: wrong rkey, a range outside the
//! peer's region, or a region without the needed `REMOTE_*` flag.
//! `IBV_WC_REM_INV_REQ_ERR`: the peer's *QP* was not granted the access
//! (the flags given to its [`InitAttr`](crate::qp::InitAttr); a FLUSH needs
//! `FLUSH_GLOBAL` or `FLUSH_PERSISTENT` there as well as on the region). A receive, READ
//! or atomic destination without `LOCAL_WRITE` is refused when posted.
//!
//! **Flushes.** `IBV_WC_WR_FLUSH_ERR`: the QP is in the error state, so
//! everything outstanding was flushed. Look for the first completion that is
//! not a flush, on this side or the peer's: it says why.
//!
//! **The peer gave up.** `the peer closed the connection before sending its
//! endpoint: its own setup most likely failed ...`: read the other side's
//! output; it refused something locally (a bad GID index, device or port).
