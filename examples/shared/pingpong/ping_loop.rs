//! The C programs' ping-pong loop, over any [`PingQp`], with its closing
//! throughput lines.

use std::time::Instant;

use rdma_verbs::prelude::*;

use super::{Common, RECV_WRID, SEND_WRID, page_size};

/// What the ping-pong loop needs to know of the options.
pub struct LoopParams {
    /// Bytes per message.
    pub size: usize,
    /// Receives kept posted.
    pub rx_depth: u32,
    /// Exchanges.
    pub iters: u32,
    /// Sleep on CQ events instead of busy-polling.
    pub use_event: bool,
    /// `-c`: the client zeroes its message's page starts, the server checks them.
    pub validate: bool,
    /// This side connected to a server (it sends first).
    pub is_client: bool,
    /// Send inline (the QP's max_inline_data covers the message).
    pub use_inline: bool,
}

impl LoopParams {
    /// The loop of a port with options `o`.
    pub fn new(o: &Common, validate: bool, use_inline: bool) -> LoopParams {
        LoopParams {
            size: o.size,
            rx_depth: o.rx_depth,
            iters: o.iters,
            use_event: o.use_event,
            validate,
            is_client: o.servername.is_some(),
            use_inline,
        }
    }
}

/// The QP of a ping-pong port: how it sends and receives one message.
pub trait PingQp {
    /// Posts a SEND of `buf` (`None`: zero bytes), inline when `inline`;
    /// returns the buffer when the NIC copied it (inline), else `None`.
    fn send(&mut self, wr_id: u64, buf: Option<Mr>, inline: bool) -> Result<Option<Mr>, String>;
    /// Posts a receive into `buf` (`None`: zero bytes).
    fn recv(&mut self, wr_id: u64, buf: Option<Mr>) -> Result<(), String>;
    /// The payload buffer of a successful receive completion.
    fn received(&mut self, wc: &mut Completion) -> Result<Option<Mr>, String>;
}

/// RC and UC send and receive alike (only the request type differs).
macro_rules! connected_ping_qp {
    ($transport:ty, $send_wr:ident) => {
        impl PingQp for Qp<$transport, Rts> {
            fn send(
                &mut self,
                wr_id: u64,
                buf: Option<Mr>,
                inline: bool,
            ) -> Result<Option<Mr>, String> {
                let err = |e: rdma_verbs::qp::PostError| format!("Couldn't post send: {}", e.error);
                match buf {
                    Some(mr) if inline => {
                        let data = mr.as_slice().map_err(|e| e.to_string())?;
                        self.post_send($send_wr::send_inline(wr_id, data))
                            .map_err(err)?;
                        // The NIC copied the data: the buffer is free again.
                        Ok(Some(mr))
                    }
                    Some(mr) => self
                        .post_send($send_wr::send(wr_id).sge(mr))
                        .map(|()| None)
                        .map_err(err),
                    None => self
                        .post_send($send_wr::send(wr_id))
                        .map(|()| None)
                        .map_err(err),
                }
            }

            fn recv(&mut self, wr_id: u64, buf: Option<Mr>) -> Result<(), String> {
                let wr = match buf {
                    Some(mr) => RecvWr::new(wr_id, mr),
                    None => RecvWr::empty(wr_id),
                };
                self.post_recv(wr).map_err(|e| e.error.to_string())
            }

            fn received(&mut self, wc: &mut Completion) -> Result<Option<Mr>, String> {
                Ok(wc.take_mr())
            }
        }
    };
}

connected_ping_qp!(Rc, SendWr);
connected_ping_qp!(Uc, UcSendWr);

/// How long the ping-pong may go without a completion before it gives up. The C
/// programs wait forever, and with their retry_cnt of 7 rxe never reports a dead peer
/// either (and a UD peer that died is never reported at all), so a peer that died
/// would leave this side spinning for good.
pub const STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// The C programs' loop: the client sends first; each side sends again once
/// its last send completed and a message arrived, `iters` times; then both
/// print the throughput lines. `first_send` is the client's first message
/// (and every buffer the loop receives into is one it sent from before, as
/// in the C programs, where one buffer serves both directions). Returns the
/// buffer it holds at the end.
pub fn run_loop<Q: PingQp>(
    qp: &mut Q,
    cq: &mut Cq,
    p: &LoopParams,
    mut first_send: Option<Mr>,
) -> Result<Option<Mr>, String> {
    let page = page_size();
    if p.is_client && p.validate {
        if let Some(b) = first_send.as_mut() {
            for i in (0..p.size).step_by(page) {
                // C: buf[i] = i / page_size % sizeof(char), which is always 0.
                b.write_at(i, &[0]).map_err(|e| e.to_string())?;
            }
        }
    }

    // The buffer to send next: the last one received (the C program's single buffer).
    let mut next_send: Option<Mr> = first_send;
    let mut pending = RECV_WRID;
    let mut rx = Receives {
        rx_depth: p.rx_depth,
        size: p.size,
        posted: p.rx_depth,
        spare: Vec::new(),
    };
    if p.is_client {
        if let Some(freed) = qp.send(SEND_WRID, next_send.take(), p.use_inline)? {
            rx.give_back(qp, Some(freed))?;
        }
        pending |= SEND_WRID;
    }

    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wcs = Vec::with_capacity(2);
    while rcnt < p.iters || scnt < p.iters {
        next_completions(cq, &mut wcs, p.use_event)?;
        for mut wc in wcs.drain(..) {
            check_status(&wc)?;
            match wc.wr_id {
                SEND_WRID => {
                    scnt += 1;
                    // A sent buffer (not inline) comes back: receive into it again.
                    if let Some(mr) = wc.take_mr() {
                        rx.give_back(qp, Some(mr))?;
                    }
                }
                RECV_WRID => {
                    rcnt += 1;
                    let last = rcnt == p.iters;
                    on_receive(qp, &mut wc, p, last, &mut rx, &mut next_send)?;
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending &= !wc.wr_id;
            if scnt < p.iters && pending == 0 {
                send_next(qp, p, &mut next_send, &mut rx)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    print_rate(p.size, p.iters, start);
    Ok(next_send)
}

/// The C programs' message for a completion that failed.
pub fn check_status(wc: &Completion) -> Result<(), String> {
    if wc.status.is_success() {
        return Ok(());
    }
    Err(format!(
        "Failed status {} ({}) for wr_id {}",
        wc.status.description(),
        wc.status.as_raw(),
        wc.wr_id
    ))
}

/// The loop's receive buffers: at most `rx_depth` posted (C: "receives to
/// post at a time"); a buffer that comes back while `rx_depth` are posted
/// waits in `spare`.
struct Receives {
    rx_depth: u32,
    size: usize,
    posted: u32,
    spare: Vec<Mr>,
}

impl Receives {
    /// Posts a receive into `buf`, or into a spare buffer (none for 0-byte
    /// messages) when `buf` is `None`; keeps `buf` spare when `rx_depth` are
    /// posted.
    fn give_back<Q: PingQp>(&mut self, qp: &mut Q, buf: Option<Mr>) -> Result<(), String> {
        let buf = match buf {
            Some(mr) if self.posted >= self.rx_depth => {
                self.spare.push(mr);
                return Ok(());
            }
            Some(mr) => Some(mr),
            None if self.size == 0 && self.posted < self.rx_depth => None,
            None => match self.spare.pop() {
                Some(mr) if self.posted < self.rx_depth => Some(mr),
                Some(mr) => {
                    self.spare.push(mr);
                    return Ok(());
                }
                None => return Ok(()),
            },
        };
        qp.recv(RECV_WRID, buf)
            .map_err(|e| format!("Couldn't post receive ({}): {e}", self.posted))?;
        self.posted += 1;
        Ok(())
    }
}

/// A message arrived: with `-c`, the server checks the page starts of the
/// `last` one; its buffer becomes the next to send, and the receive is
/// replaced.
fn on_receive<Q: PingQp>(
    qp: &mut Q,
    wc: &mut Completion,
    p: &LoopParams,
    last: bool,
    rx: &mut Receives,
    next_send: &mut Option<Mr>,
) -> Result<(), String> {
    rx.posted -= 1;
    let got = qp.received(wc)?;
    if p.validate && !p.is_client && last {
        if let Some(mr) = &got {
            let page = page_size();
            let data = mr.as_slice().map_err(|e| e.to_string())?;
            for i in (0..p.size).step_by(page) {
                if data[i] != 0 {
                    println!("invalid data in page {}", i / page);
                }
            }
        }
    }
    if p.size > 0 {
        let got = got.ok_or("receive came back without its buffer")?;
        if let Some(old) = next_send.replace(got) {
            rx.give_back(qp, Some(old))?;
        }
    }
    // Keep rx_depth receives posted (a spare buffer, or none for 0 bytes).
    rx.give_back(qp, None)
}

/// Sends the buffer last received (none for 0-byte messages); an inline
/// send's buffer is free at once and goes back to the receives.
fn send_next<Q: PingQp>(
    qp: &mut Q,
    p: &LoopParams,
    next_send: &mut Option<Mr>,
    rx: &mut Receives,
) -> Result<(), String> {
    let buf = if p.size == 0 { None } else { next_send.take() };
    if p.size > 0 && buf.is_none() {
        return Err("Couldn't post send: no buffer".into());
    }
    if let Some(freed) = qp.send(SEND_WRID, buf, p.use_inline)? {
        rx.give_back(qp, Some(freed))?;
    }
    Ok(())
}

/// Clears `wcs` and fills it with the next completions: busy-polling, or
/// sleeping on the CQ's channel with `use_event`. A peer that stops
/// answering (its process died or its QP failed) ends the run with an error
/// after [`STALL_LIMIT`] without a completion, instead of a wait forever.
pub fn next_completions(
    cq: &mut Cq,
    wcs: &mut Vec<Completion>,
    use_event: bool,
) -> Result<(), String> {
    let stalled = || {
        format!(
            "error: no completion for {} s: the peer stopped answering (its process died or \
             its QP failed)",
            STALL_LIMIT.as_secs()
        )
    };
    wcs.clear();
    if use_event {
        // 0 completions: the limit passed.
        let n = cq
            .wait_poll(wcs, Some(STALL_LIMIT))
            .map_err(|e| format!("Failed to get cq_event: {e}"))?;
        if n == 0 {
            return Err(stalled());
        }
    } else {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        while cq.poll(wcs).map_err(|e| format!("poll CQ failed {e}"))? == 0 {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && idle_since.elapsed() > STALL_LIMIT {
                return Err(stalled());
            }
        }
    }
    Ok(())
}

/// The C programs' closing lines: bytes and iterations per second since
/// `start`, for `iters` exchanges of `size` bytes each way.
pub fn print_rate(size: usize, iters: u32, start: Instant) {
    let usec = start.elapsed().as_secs_f64() * 1e6;
    let bytes = size as i64 * i64::from(iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        iters,
        usec / 1e6,
        usec / f64::from(iters)
    );
}
