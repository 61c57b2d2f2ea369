//! The prelude brings the common types in without shadowing the `tokio` crate.

#[cfg(feature = "tokio")]
#[test]
fn the_prelude_leaves_the_tokio_crate_reachable() {
    use rdma_verbs::prelude::*;
    // `tokio` here is the crate: with `use rdma_verbs::*` it would be the module.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(async { 7 }), 7);
    let _: Option<Qp<Rc, Reset>> = None;
    let _: fn(&Context, u32) -> Result<Cq> = Cq::new;
}

#[test]
fn the_prelude_names_the_types_of_an_rc_program() {
    use rdma_verbs::prelude::*;
    let gid: Gid = "::ffff:10.99.0.1".parse().unwrap();
    assert_eq!(gid.to_string(), "::ffff:10.99.0.1");
    assert!(matches!(
        "nonsense".parse::<Gid>(),
        Err(Error::InvalidGid { .. })
    ));
    type RcProgram = (
        Qp<Rc, Rts>,
        Mr,
        SendWr<'static>,
        RecvWr,
        Completion,
        Endpoint,
    );
    let _: Option<RcProgram> = None;
}
