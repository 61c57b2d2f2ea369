//! The direct path of a [`GpuBuffer`](super::GpuBuffer): the registered device
//! memory itself is posted, in WRITEs of at most [`MAX_WRITE`] bytes.

use std::ops::Range;

use super::GdrError;
use super::ledger::{WriteLedger, offset_by};
use crate::cq::Cq;
use crate::error::Result;
use crate::mr::{Mr, RemoteMr};
use crate::qp::{Qp, Rc, Rts};

/// Largest single RDMA WRITE the direct path posts (SGE lengths are 32-bit).
pub(crate) const MAX_WRITE: usize = 1 << 30;
/// Direct-path WRITEs in flight at once.
const DIRECT_DEPTH: usize = 8;

/// Joins the pieces of one registration back into a single `Mr` when they are
/// all there and adjacent; otherwise leaves them as they are.
pub(crate) fn reassemble(pieces: &mut Vec<Mr>) -> Option<Mr> {
    pieces.sort_by_key(Mr::addr);
    let mut it = std::mem::take(pieces).into_iter();
    let mut acc = it.next()?;
    for p in it {
        if let Err(p) = acc.unsplit(p) {
            pieces.push(p);
        }
    }
    if pieces.is_empty() {
        Some(acc)
    } else {
        pieces.push(acc);
        None
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn direct_write(
    ledger: &mut WriteLedger,
    qp: &mut Qp<Rc, Rts>,
    cq: &mut Cq,
    pieces: &mut Vec<Mr>,
    total: usize,
    range: Range<usize>,
    remote: RemoteMr,
    remote_offset: u64,
) -> Result<()> {
    let whole = match reassemble(pieces) {
        Some(mr) if mr.len() == total => mr,
        other => {
            pieces.extend(other);
            return Err(GdrError::BuffersInFlight.into());
        }
    };
    // Cut [range) out of the registration; the rest waits in `returned`.
    let mut rest = whole;
    if range.start > 0 {
        let mid = rest.split_off(range.start)?;
        ledger.returned.push(std::mem::replace(&mut rest, mid));
    }
    if range.end < total {
        let tail = rest.split_off(range.end - range.start)?;
        ledger.returned.push(tail);
    }
    let mut rest = Some(rest);
    let mut sent = 0usize;
    while let Some(mut cur) = rest.take() {
        if ledger.first_error.is_some() {
            ledger.returned.push(cur);
            break;
        }
        if cur.len() > MAX_WRITE {
            rest = Some(cur.split_off(MAX_WRITE)?);
        }
        while ledger.outstanding >= DIRECT_DEPTH {
            if let Err(e) = ledger.wait(cq) {
                ledger.returned.push(cur);
                ledger.returned.extend(rest);
                return Err(e);
            }
        }
        let n = cur.len();
        let at = match offset_by("remote offset", remote_offset, sent) {
            Ok(at) => at,
            Err(e) => {
                ledger.returned.push(cur);
                ledger.returned.extend(rest);
                return Err(e);
            }
        };
        if let Err(e) = ledger.post(qp, cq, cur, remote, at) {
            ledger.returned.extend(rest);
            return Err(e);
        }
        sent += n;
    }
    Ok(())
}
