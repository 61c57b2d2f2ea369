//! Runs in the soft-RoCE guest through the cargo runner `rdma-verbs-vm run --` (or on the
//! host, when it has an RDMA device).

use rdma_verbs::device::PortState;

#[test]
fn runner_sets_the_environment() {
    let device = std::env::var("RDMA_VERBS_DEVICE").expect("RDMA_VERBS_DEVICE is set");
    if device == "rxe0" {
        assert_eq!(std::env::var("RDMA_VERBS_ADDR").as_deref(), Ok("10.99.0.1"));
    }
    // The test runs in the crate's directory, as cargo runs it on the host.
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(cwd, std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
}

#[test]
fn first_device_port_is_active() {
    let (name, state) = vm_runner_crate::port_state(None).expect("open and query the device");
    assert_eq!(name, std::env::var("RDMA_VERBS_DEVICE").unwrap());
    assert_eq!(state, PortState::Active, "{name} port 1");
}
