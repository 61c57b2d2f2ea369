//@ check-pass
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rc, Rts};
use rdma_verbs::qp::scope::{Dst, ScopedSend, Src};

// Control: buffers borrowed from outside the scope can be lent, and read
// again once it has ended.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, src: &Mr, dst: &mut Mr, remote: RemoteMr) -> Result<()> {
    let s_src = Src::new(src)?;
    let d = Dst::new(dst)?;
    cq.scope(|s| {
        let mut q = s.attach(qp)?;
        q.post_send(&ScopedSend::write(1, s_src, remote, 0))?;
        q.post_send(&ScopedSend::read(2, d, remote, 0))?;
        Ok(())
    })?;
    dst.fill(0)?;
    Ok(())
}
fn main() {}
