/* The C side of `cargo xtask scale`'s registration, QP-lifecycle and serial
 * connection rows: the same loops as `examples/scale.rs`, on libibverbs and
 * librdmacm directly.
 *
 *   scale_c reg SIZE ITERS    ibv_reg_mr + ibv_dereg_mr of one touched buffer
 *   scale_c qp ITERS GID      ibv_create_qp, INIT, RTR (to a peer QP), RTS, ibv_destroy_qp
 *   scale_c cm ADDR PORT N    N connections set up one after another, each step
 *                             waiting for its event, as `scale cm-client` (blocking)
 *
 * reg and qp print `iters N` and `ops_per_s R`, cm `step NAME TOTAL_US` per step
 * and `conns N`, as the example does. The device is $RDMA_VERBS_DEVICE, else the
 * first one. */
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

static void die(const char *what) {
    perror(what);
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static struct ibv_context *open_device(void) {
    const char *want = getenv("RDMA_VERBS_DEVICE");
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list || n == 0)
        die("ibv_get_device_list");
    for (int i = 0; i < n; i++) {
        if (!want || !*want || strcmp(ibv_get_device_name(list[i]), want) == 0) {
            struct ibv_context *ctx = ibv_open_device(list[i]);
            if (!ctx)
                die("ibv_open_device");
            ibv_free_device_list(list);
            return ctx;
        }
    }
    fprintf(stderr, "no device %s\n", want);
    exit(1);
}

static void report(long iters, double secs) {
    printf("iters %ld\nops_per_s %.1f\n", iters, iters / secs);
}

static void reg(struct ibv_pd *pd, size_t size, long iters) {
    char *buf = malloc(size);
    if (!buf)
        die("malloc");
    memset(buf, 1, size);
    double t = now();
    for (long i = 0; i < iters; i++) {
        struct ibv_mr *mr = ibv_reg_mr(pd, buf, size, ACCESS);
        if (!mr)
            die("ibv_reg_mr");
        if (ibv_dereg_mr(mr))
            die("ibv_dereg_mr");
    }
    report(iters, now() - t);
    free(buf);
}

static struct ibv_qp *create(struct ibv_pd *pd, struct ibv_cq *cq) {
    struct ibv_qp_init_attr a = {
        .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 128, .max_recv_wr = 128, .max_send_sge = 1, .max_recv_sge = 1},
    };
    struct ibv_qp *qp = ibv_create_qp(pd, &a);
    if (!qp)
        die("ibv_create_qp");
    return qp;
}

static void to_init(struct ibv_qp *qp) {
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = ACCESS};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        die("modify to INIT");
}

static void qp_life(struct ibv_context *ctx, struct ibv_pd *pd, long iters, int gid_index) {
    struct ibv_cq *cq = ibv_create_cq(ctx, 512, NULL, NULL, 0);
    if (!cq)
        die("ibv_create_cq");
    struct ibv_port_attr port;
    union ibv_gid gid;
    if (ibv_query_port(ctx, 1, &port) || ibv_query_gid(ctx, 1, gid_index, &gid))
        die("ibv_query_port/gid");
    struct ibv_qp *peer = create(pd, cq);
    to_init(peer);
    double t = now();
    for (long i = 0; i < iters; i++) {
        struct ibv_qp *qp = create(pd, cq);
        to_init(qp);
        struct ibv_qp_attr r = {
            .qp_state = IBV_QPS_RTR, .path_mtu = port.active_mtu, .dest_qp_num = peer->qp_num,
            .rq_psn = 0, .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
            .ah_attr = {.dlid = port.lid, .port_num = 1, .is_global = 1,
                        .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 1}},
        };
        if (ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                      IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                      IBV_QP_MIN_RNR_TIMER))
            die("modify to RTR");
        struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS, .sq_psn = 0, .timeout = 14,
                                .retry_cnt = 6, .rnr_retry = 7, .max_rd_atomic = 1};
        if (ibv_modify_qp(qp, &s, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                      IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                      IBV_QP_MAX_QP_RD_ATOMIC))
            die("modify to RTS");
        if (ibv_destroy_qp(qp))
            die("ibv_destroy_qp");
    }
    report(iters, now() - t);
    ibv_destroy_qp(peer);
    ibv_destroy_cq(cq);
}

/* How long a resolution, and each wait for an event, may take: the example's `WAIT`. */
#define WAIT_MS 30000

/* Waits up to WAIT_MS for the next event on `ch`, which must be `want` for `id`
 * (NULL: any id); a TIMEWAIT_EXIT of a connection already down is acknowledged and
 * skipped. Anything else ends the program. */
static void expect(struct rdma_event_channel *ch, struct rdma_cm_id *id,
                   enum rdma_cm_event_type want) {
    struct rdma_cm_event *ev;
    for (;;) {
        struct pollfd p = {.fd = ch->fd, .events = POLLIN};
        int ready = poll(&p, 1, WAIT_MS);
        if (ready < 0)
            die("poll");
        if (ready == 0) {
            fprintf(stderr, "no event in %d ms, expected %s\n", WAIT_MS, rdma_event_str(want));
            exit(1);
        }
        if (rdma_get_cm_event(ch, &ev))
            die("rdma_get_cm_event");
        if (ev->event != RDMA_CM_EVENT_TIMEWAIT_EXIT || want == RDMA_CM_EVENT_TIMEWAIT_EXIT)
            break;
        rdma_ack_cm_event(ev);
    }
    struct rdma_cm_id *got = ev->id;
    if (ev->event != want || (id && got != id)) {
        fprintf(stderr, "event %s (status %d), expected %s\n", rdma_event_str(ev->event),
                ev->status, rdma_event_str(want));
        exit(1);
    }
    rdma_ack_cm_event(ev);
}

/* Prints the time since `*t` as step `name` and restarts it. */
static void step(const char *name, double *t) {
    double n = now();
    printf("step %s %.0f\n", name, (n - *t) * 1e6);
    *t = n;
}

/* The serial client: every step one connection at a time, on one event channel,
 * each call followed by the wait for its event; the QPs on one PD and CQ. As the
 * crate's id, each id holds its QP only for the handshake (librdmacm moves it to
 * RTR and RTS); the teardown sends each disconnect and destroys each QP itself. */
static int cm_serial(const char *addr, int port, int n) {
    struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, addr, &dst.sin_addr) != 1) {
        fprintf(stderr, "not an IPv4 address: %s\n", addr);
        return 2;
    }
    struct rdma_cm_id **ids = calloc(n, sizeof(*ids));
    struct ibv_qp **qps = calloc(n, sizeof(*qps));
    if (!ids || !qps)
        die("calloc");
    /* librdmacm opens every device on its first channel, before the timing. */
    struct rdma_event_channel *ch = rdma_create_event_channel();
    if (!ch)
        die("rdma_create_event_channel");
    double t = now();
    for (int i = 0; i < n; i++)
        if (rdma_create_id(ch, &ids[i], NULL, RDMA_PS_TCP))
            die("rdma_create_id");
    step("create_id", &t);
    for (int i = 0; i < n; i++) {
        if (rdma_resolve_addr(ids[i], NULL, (struct sockaddr *)&dst, WAIT_MS))
            die("rdma_resolve_addr");
        expect(ch, ids[i], RDMA_CM_EVENT_ADDR_RESOLVED);
    }
    step("resolve_addr", &t);
    for (int i = 0; i < n; i++) {
        if (rdma_resolve_route(ids[i], WAIT_MS))
            die("rdma_resolve_route");
        expect(ch, ids[i], RDMA_CM_EVENT_ROUTE_RESOLVED);
    }
    step("resolve_route", &t);
    struct ibv_pd *pd = ibv_alloc_pd(ids[0]->verbs);
    struct ibv_cq *cq = ibv_create_cq(ids[0]->verbs, 2 * n + 16, NULL, NULL, 0);
    if (!pd || !cq)
        die("ibv_alloc_pd/ibv_create_cq");
    for (int i = 0; i < n; i++) {
        struct ibv_qp_init_attr a = {
            .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
            .cap = {.max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1},
        };
        if (rdma_create_qp(ids[i], pd, &a))
            die("rdma_create_qp");
    }
    step("create_qp", &t);
    struct rdma_conn_param p = {.responder_resources = 1, .initiator_depth = 1,
                                .retry_count = 6, .rnr_retry_count = 7};
    for (int i = 0; i < n; i++) {
        if (rdma_connect(ids[i], &p))
            die("rdma_connect");
        expect(ch, ids[i], RDMA_CM_EVENT_ESTABLISHED);
        qps[i] = ids[i]->qp;
        ids[i]->qp = NULL;
    }
    step("connect", &t);
    for (int i = 0; i < n; i++)
        if (rdma_disconnect(ids[i]))
            die("rdma_disconnect");
    for (int i = 0; i < n; i++)
        if (ibv_destroy_qp(qps[i]))
            die("ibv_destroy_qp");
    for (int i = 0; i < n; i++)
        expect(ch, NULL, RDMA_CM_EVENT_DISCONNECTED);
    step("disconnect", &t);
    for (int i = 0; i < n; i++)
        rdma_destroy_id(ids[i]);
    step("destroy", &t);
    printf("conns %d\n", n);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    rdma_destroy_event_channel(ch);
    free(qps);
    free(ids);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "cm")) {
        long port = strtol(argv[3], NULL, 10), n = strtol(argv[4], NULL, 10);
        if (port < 1 || port > 65535 || n < 1 || n > 65536) {
            fprintf(stderr, "scale_c cm: PORT 1 to 65535, N 1 to 65536\n");
            return 2;
        }
        return cm_serial(argv[2], (int)port, (int)n);
    }
    if (argc < 3 || (strcmp(argv[1], "reg") && strcmp(argv[1], "qp"))) {
        fprintf(stderr, "usage: scale_c reg SIZE ITERS | scale_c qp ITERS GID_INDEX | "
                        "scale_c cm ADDR PORT N\n");
        return 2;
    }
    struct ibv_context *ctx = open_device();
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    if (!pd)
        die("ibv_alloc_pd");
    if (!strcmp(argv[1], "reg") && argc == 4)
        reg(pd, strtoull(argv[2], NULL, 0), atol(argv[3]));
    else if (!strcmp(argv[1], "qp") && argc == 4)
        qp_life(ctx, pd, atol(argv[2]), atoi(argv[3]));
    else {
        fprintf(stderr, "wrong number of arguments\n");
        return 2;
    }
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    return 0;
}
