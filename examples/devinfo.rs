//! Prints what `ibv_devinfo -v` prints for one device.
//!
//! Usage: `devinfo [-d DEVICE] [-i PORT] [-l]`; the device defaults to
//! `$RDMA_VERBS_DEVICE`, else the first device. `-l` lists devices.

use std::process::ExitCode;

use rdma_verbs::context::{Context, DeviceAttr, PortAttr};
use rdma_verbs::device::{Transport, devices, format_guid};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devinfo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let Some((dev, only_port)) = parse_args()? else {
        return Ok(());
    };
    let list = devices()?;
    let d = list.find(dev.as_deref())?;
    let ctx: Context = d.open()?;
    let a = ctx.query_device()?;
    if let Some(p) = only_port.filter(|&p| p == 0 || p > a.phys_port_cnt) {
        return Err(format!(
            "-i {p}: {} has port(s) 1 to {}",
            ctx.name(),
            a.phys_port_cnt
        )
        .into());
    }
    print_device(&ctx, d.transport(), &a);
    let gids = ctx.gid_table()?;
    for port in 1..=a.phys_port_cnt {
        if only_port.is_some_and(|p| p != port) {
            continue;
        }
        let p = ctx.query_port(port)?;
        print_port(port, &p);
        for g in gids.iter().filter(|g| g.port == port) {
            let netdev = g.netdev.as_deref().unwrap_or("-");
            println!(
                "\t\t\tGID[{:>3}]:\t\t{}, {}, {}",
                g.index, g.gid, g.gid_type, netdev
            );
        }
        println!();
    }
    Ok(())
}

/// The command line: the device and the one port to show, or `None` when
/// it asked for the list or the usage (printed here).
#[allow(clippy::type_complexity)]
fn parse_args() -> Result<Option<(Option<String>, Option<u8>)>, Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut dev = std::env::var("RDMA_VERBS_DEVICE").ok();
    let mut only_port = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "-d" | "--ib-dev" => dev = Some(args.next().ok_or("-d needs a device name")?),
            "-i" | "--ib-port" => {
                let v = args.next().ok_or("-i needs a port")?;
                let port = v
                    .parse::<u8>()
                    .map_err(|e| format!("-i: `{v}` is not a port number (1 to 255): {e}"))?;
                only_port = Some(port)
            }
            "-l" | "--list" => {
                let list = devices()?;
                println!(
                    "{} HCA{} found:",
                    list.len(),
                    if list.len() == 1 { "" } else { "s" }
                );
                for d in list.iter() {
                    println!("\t{}", d.name());
                }
                return Ok(None);
            }
            "-h" | "--help" => {
                println!("usage: devinfo [-d DEVICE] [-i PORT] [-l]");
                return Ok(None);
            }
            other => return Err(format!("unknown argument `{other}` (try --help)").into()),
        }
    }
    Ok(Some((dev, only_port)))
}

/// The device's lines, as `ibv_devinfo -v` prints them.
fn print_device(ctx: &Context, transport: Transport, a: &DeviceAttr) {
    println!("hca_id:\t{}", ctx.name());
    println!("\ttransport:\t\t\t{} ({})", transport, transport.as_raw());
    println!("\tfw_ver:\t\t\t\t{}", a.fw_ver);
    println!("\tnode_guid:\t\t\t{}", format_guid(a.node_guid));
    println!("\tsys_image_guid:\t\t\t{}", format_guid(a.sys_image_guid));
    println!("\tvendor_id:\t\t\t{:#06x}", a.vendor_id);
    println!("\tvendor_part_id:\t\t\t{}", a.vendor_part_id);
    println!("\thw_ver:\t\t\t\t{:#X}", a.hw_ver);
    println!("\tphys_port_cnt:\t\t\t{}", a.phys_port_cnt);
    println!("\tmax_mr_size:\t\t\t{:#x}", a.max_mr_size);
    println!("\tpage_size_cap:\t\t\t{:#x}", a.page_size_cap);
    println!("\tmax_qp:\t\t\t\t{}", a.max_qp);
    println!("\tmax_qp_wr:\t\t\t{}", a.max_qp_wr);
    println!("\tdevice_cap_flags:\t\t{:#010x}", a.device_cap_flags);
    println!("\tmax_sge:\t\t\t{}", a.max_sge);
    println!("\tmax_sge_rd:\t\t\t{}", a.max_sge_rd);
    println!("\tmax_cq:\t\t\t\t{}", a.max_cq);
    println!("\tmax_cqe:\t\t\t{}", a.max_cqe);
    println!("\tmax_mr:\t\t\t\t{}", a.max_mr);
    println!("\tmax_pd:\t\t\t\t{}", a.max_pd);
    println!("\tmax_qp_rd_atom:\t\t\t{}", a.max_qp_rd_atom);
    println!("\tmax_ee_rd_atom:\t\t\t{}", a.max_ee_rd_atom);
    println!("\tmax_res_rd_atom:\t\t{}", a.max_res_rd_atom);
    println!("\tmax_qp_init_rd_atom:\t\t{}", a.max_qp_init_rd_atom);
    println!("\tmax_ee_init_rd_atom:\t\t{}", a.max_ee_init_rd_atom);
    println!(
        "\tatomic_cap:\t\t\t{} ({})",
        a.atomic_cap,
        a.atomic_cap.as_raw()
    );
    println!("\tmax_ee:\t\t\t\t{}", a.max_ee);
    println!("\tmax_rdd:\t\t\t{}", a.max_rdd);
    println!("\tmax_mw:\t\t\t\t{}", a.max_mw);
    println!("\tmax_raw_ipv6_qp:\t\t{}", a.max_raw_ipv6_qp);
    println!("\tmax_raw_ethy_qp:\t\t{}", a.max_raw_ethy_qp);
    println!("\tmax_mcast_grp:\t\t\t{}", a.max_mcast_grp);
    println!("\tmax_mcast_qp_attach:\t\t{}", a.max_mcast_qp_attach);
    println!(
        "\tmax_total_mcast_qp_attach:\t{}",
        a.max_total_mcast_qp_attach
    );
    println!("\tmax_ah:\t\t\t\t{}", a.max_ah);
    println!("\tmax_fmr:\t\t\t{}", a.max_fmr);
    println!("\tmax_srq:\t\t\t{}", a.max_srq);
    println!("\tmax_srq_wr:\t\t\t{}", a.max_srq_wr);
    println!("\tmax_srq_sge:\t\t\t{}", a.max_srq_sge);
    println!("\tmax_pkeys:\t\t\t{}", a.max_pkeys);
    println!("\tlocal_ca_ack_delay:\t\t{}", a.local_ca_ack_delay);
}

/// Port `port`'s lines before its GIDs.
fn print_port(port: u8, p: &PortAttr) {
    println!("\t\tport:\t{port}");
    println!("\t\t\tstate:\t\t\t{} ({})", p.state, p.state.as_raw());
    println!("\t\t\tmax_mtu:\t\t{} ({})", p.max_mtu, p.max_mtu.as_raw());
    println!(
        "\t\t\tactive_mtu:\t\t{} ({})",
        p.active_mtu,
        p.active_mtu.as_raw()
    );
    println!("\t\t\tsm_lid:\t\t\t{}", p.sm_lid);
    println!("\t\t\tport_lid:\t\t{}", p.lid);
    println!("\t\t\tport_lmc:\t\t{:#04x}", p.lmc);
    println!("\t\t\tlink_layer:\t\t{}", p.link_layer);
    println!("\t\t\tmax_msg_sz:\t\t{:#x}", p.max_msg_sz);
    println!("\t\t\tport_cap_flags:\t\t{:#010x}", p.port_cap_flags);
    println!("\t\t\tport_cap_flags2:\t{:#06x}", p.port_cap_flags2);
    println!("\t\t\tmax_vl_num:\t\t{}", p.max_vl_num);
    println!("\t\t\tbad_pkey_cntr:\t\t{:#x}", p.bad_pkey_cntr);
    println!("\t\t\tqkey_viol_cntr:\t\t{:#x}", p.qkey_viol_cntr);
    println!("\t\t\tsm_sl:\t\t\t{}", p.sm_sl);
    println!("\t\t\tpkey_tbl_len:\t\t{}", p.pkey_tbl_len);
    println!("\t\t\tgid_tbl_len:\t\t{}", p.gid_tbl_len);
    println!("\t\t\tsubnet_timeout:\t\t{}", p.subnet_timeout);
    println!("\t\t\tinit_type_reply:\t{}", p.init_type_reply);
    println!("\t\t\tactive_width:\t\t{}", p.active_width);
    println!("\t\t\tactive_speed:\t\t{}", p.active_speed);
    println!("\t\t\tphys_state:\t\t{}", p.phys_state);
}
