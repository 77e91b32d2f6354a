/* A runnel external client in C, written from protocols/EXTERNAL.md: plays CartPole-like episodes
 * against a running policy server (remote inference) and uploads each episode as chunks of at most
 * fragment_length steps (the server's welcome says how many; it refuses longer chunks).
 *
 *   cc -O2 -o cartpole_client cartpole_client.c -lzmq        (libzmq-dev from the distribution)
 *   ./cartpole_client tcp://127.0.0.1:9900 [episodes] [agents]
 *
 * With agents > 1 it plays that many CartPoles as one multi-agent episode against a multi-agent
 * server (EXTERNAL.md section 10, protocol version 2): agent i is the int i, each finishes on its
 * own, and the server records the episode, so nothing is uploaded.
 *
 * Needs only libzmq: the few msgpack values the protocol uses are written and read by hand below,
 * and frames are sent uncompressed (flags 0), so neither msgpack-c nor liblz4 is required.
 * Build with -DRUNNEL_NO_ZMQ_H to declare libzmq's functions here instead of including <zmq.h>
 * (linking against any libzmq 4.x, e.g. the copy pyzmq ships). Exit status 0: every episode was
 * played and every chunk received by the server. */
#include <math.h>
#include <time.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef RUNNEL_NO_ZMQ_H
#define ZMQ_DEALER 5
#define ZMQ_LINGER 17
#define ZMQ_RCVTIMEO 27
#define ZMQ_SNDMORE 2
#define ZMQ_RCVMORE 13
void *zmq_ctx_new(void);
int zmq_ctx_term(void *);
void *zmq_socket(void *, int);
int zmq_close(void *);
int zmq_connect(void *, const char *);
int zmq_setsockopt(void *, int, const void *, size_t);
int zmq_getsockopt(void *, int, void *, size_t *);
int zmq_send(void *, const void *, size_t, int);
int zmq_recv(void *, void *, size_t, int);
#else
#include <zmq.h>
#endif

/* ---- a growable buffer and the msgpack values the protocol needs ---------------------------- */
typedef struct { uint8_t *p; size_t n, cap; } buf_t;

static void put(buf_t *b, const void *src, size_t n) {
    if (b->n + n > b->cap) { b->cap = (b->n + n) * 2 + 64; b->p = realloc(b->p, b->cap); }
    memcpy(b->p + b->n, src, n); b->n += n;
}
static void put8(buf_t *b, uint8_t v) { put(b, &v, 1); }
static void put_be(buf_t *b, uint64_t v, int bytes) { for (int i = bytes - 1; i >= 0; i--) put8(b, (uint8_t)(v >> (8 * i))); }
static void put_le(buf_t *b, uint64_t v, int bytes) { for (int i = 0; i < bytes; i++) put8(b, (uint8_t)(v >> (8 * i))); }
static void mp_map(buf_t *b, int n) { put8(b, 0x80 | n); }             /* n < 16 */
static void mp_array(buf_t *b, uint32_t n) { if (n < 16) put8(b, 0x90 | n); else { put8(b, 0xdd); put_be(b, n, 4); } }
static void mp_str(buf_t *b, const char *s) { size_t n = strlen(s); put8(b, 0xd9); put8(b, (uint8_t)n); put(b, s, n); }
static void mp_int(buf_t *b, int64_t v) { put8(b, 0xd3); put_be(b, (uint64_t)v, 8); }
static void mp_double(buf_t *b, double v) { uint64_t u; memcpy(&u, &v, 8); put8(b, 0xcb); put_be(b, u, 8); }
static void mp_bool(buf_t *b, int v) { put8(b, v ? 0xc3 : 0xc2); }
static void mp_nil(buf_t *b) { put8(b, 0xc0); }

/* An array as the codec's ext type 1: offset u64, nbytes u64, ndim u8, shape u64 x ndim, dtype. */
static void mp_array_ext(buf_t *meta, buf_t *region, const void *data, size_t nbytes, const uint64_t *shape,
                         int ndim, const char *dtype) {
    while (region->n % 16) put8(region, 0);
    uint64_t offset = region->n;
    put(region, data, nbytes);
    size_t len = 8 + 8 + 1 + 8 * (size_t)ndim + strlen(dtype);
    put8(meta, 0xc7); put8(meta, (uint8_t)len); put8(meta, 1);         /* ext 8, type 1 */
    put_le(meta, offset, 8); put_le(meta, nbytes, 8); put8(meta, (uint8_t)ndim);
    for (int i = 0; i < ndim; i++) put_le(meta, shape[i], 8);
    put(meta, dtype, strlen(dtype));
}

/* A whole codec frame: 32-byte header, msgpack meta, padding to 16, array region. */
static buf_t frame(buf_t *meta, buf_t *region) {
    buf_t f = {0};
    size_t padded = (meta->n + 15) / 16 * 16, raw = padded + region->n;
    put(&f, "RNNL", 4); put8(&f, 1); put8(&f, 0); put_le(&f, 0, 2);
    put_le(&f, meta->n, 8); put_le(&f, raw, 8); put_le(&f, raw, 8);
    put(&f, meta->p, meta->n);
    for (size_t i = meta->n; i < padded; i++) put8(&f, 0);
    put(&f, region->p, region->n);
    return f;
}

/* ---- reading the replies: find a key of the top-level map and decode simple values ----------- */
typedef struct { const uint8_t *p, *end; } rd_t;
static uint64_t be(const uint8_t *p, int n) { uint64_t v = 0; for (int i = 0; i < n; i++) v = v << 8 | p[i]; return v; }

static int skip(rd_t *r);
static int str_len(rd_t *r, const uint8_t **s) {   /* -1: not a string */
    uint8_t t = *r->p; size_t n, h;
    if ((t & 0xe0) == 0xa0) { n = t & 0x1f; h = 1; }
    else if (t == 0xd9) { n = r->p[1]; h = 2; } else if (t == 0xda) { n = be(r->p + 1, 2); h = 3; }
    else return -1;
    *s = r->p + h; r->p += h + n; return (int)n;
}
static int container(rd_t *r, int *is_map) {   /* element count of a map/array, or -1 */
    uint8_t t = *r->p;
    if ((t & 0xf0) == 0x80) { *is_map = 1; r->p++; return t & 0x0f; }
    if ((t & 0xf0) == 0x90) { *is_map = 0; r->p++; return t & 0x0f; }
    if (t == 0xde || t == 0xdc) { *is_map = t == 0xde; int n = (int)be(r->p + 1, 2); r->p += 3; return n; }
    if (t == 0xdf || t == 0xdd) { *is_map = t == 0xdf; int n = (int)be(r->p + 1, 4); r->p += 5; return n; }
    return -1;
}
static int skip(rd_t *r) {
    uint8_t t = *r->p; const uint8_t *s; int is_map;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) { r->p++; return 0; }
    if (str_len(r, &s) >= 0) return 0;
    int n = container(r, &is_map);
    if (n >= 0) { for (int i = 0; i < n * (is_map ? 2 : 1); i++) skip(r); return 0; }
    static const int fixed[] = {[0xca] = 5, [0xcb] = 9, [0xcc] = 2, [0xcd] = 3, [0xce] = 5, [0xcf] = 9,
                                [0xd0] = 2, [0xd1] = 3, [0xd2] = 5, [0xd3] = 9};
    if (t >= 0xca && t <= 0xd3 && fixed[t]) { r->p += fixed[t]; return 0; }
    if (t == 0xc4) { r->p += 2 + r->p[1]; return 0; }
    return -1;
}
static double number(rd_t *r) {
    uint8_t t = *r->p;
    if (t <= 0x7f) { r->p++; return t; }
    if (t >= 0xe0) { r->p++; return (int8_t)t; }
    if (t == 0xcb) { uint64_t u = be(r->p + 1, 8); double d; memcpy(&d, &u, 8); r->p += 9; return d; }
    if (t == 0xca) { uint32_t u = (uint32_t)be(r->p + 1, 4); float f; memcpy(&f, &u, 4); r->p += 5; return f; }
    int n = t == 0xcc || t == 0xd0 ? 1 : t == 0xcd || t == 0xd1 ? 2 : t == 0xce || t == 0xd2 ? 4 : 8;
    uint64_t u = be(r->p + 1, n); r->p += 1 + n;
    if (t >= 0xd0) { int64_t v = n == 1 ? (int8_t)u : n == 2 ? (int16_t)u : n == 4 ? (int32_t)u : (int64_t)u; return (double)v; }
    return (double)u;
}
static int find(const uint8_t *msg, size_t len, const char *key, rd_t *out) {   /* 1 if found */
    rd_t r = {msg, msg + len}; int is_map; const uint8_t *s;
    int n = container(&r, &is_map);
    for (int i = 0; i < n; i++) {
        int k = str_len(&r, &s);
        if (k == (int)strlen(key) && memcmp(s, key, (size_t)k) == 0) { *out = r; return 1; }
        skip(&r);
    }
    return 0;
}
static int is_op(const uint8_t *msg, size_t len, const char *op) {
    rd_t r; const uint8_t *s;
    return find(msg, len, "op", &r) && str_len(&r, &s) == (int)strlen(op) && memcmp(s, op, strlen(op)) == 0;
}

/* ---- requests ------------------------------------------------------------------------------------ */
static uint8_t reply[1 << 16];
static size_t reply_len;
static int64_t next_id = 1;

static int request(void *sock, buf_t *header, buf_t *body, int64_t id) {
    if (zmq_send(sock, header->p, header->n, body ? ZMQ_SNDMORE : 0) < 0) return -1;
    if (body && zmq_send(sock, body->p, body->n, 0) < 0) return -1;
    for (;;) {   /* replies to other requests (and 'committed' notices) are skipped */
        int n = zmq_recv(sock, reply, sizeof reply, 0);
        if (n < 0) return -1;
        reply_len = (size_t)n < sizeof reply ? (size_t)n : sizeof reply;
        int more = 0; size_t sz = sizeof more;
        zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz);
        while (more) { char tmp[256]; zmq_recv(sock, tmp, sizeof tmp, 0); zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz); }
        rd_t r;
        if (find(reply, reply_len, "id", &r) && (int64_t)number(&r) == id) return 0;
    }
}

/* ---- CartPole's physics (gymnasium's CartPole-v1 equations) ------------------------------------- */
typedef struct { double x, x_dot, theta, theta_dot; } cart_t;
static double uniform(void) { return (double)rand() / RAND_MAX * 0.1 - 0.05; }
static int cart_step(cart_t *c, int action) {   /* 1: the episode ended */
    const double g = 9.8, mc = 1.0, mp = 0.1, total = mc + mp, l = 0.5, pml = mp * l, tau = 0.02;
    double force = action ? 10.0 : -10.0, ct = cos(c->theta), st = sin(c->theta);
    double temp = (force + pml * c->theta_dot * c->theta_dot * st) / total;
    double theta_acc = (g * st - ct * temp) / (l * (4.0 / 3.0 - mp * ct * ct / total));
    double x_acc = temp - pml * theta_acc * ct / total;
    c->x += tau * c->x_dot; c->x_dot += tau * x_acc; c->theta += tau * c->theta_dot; c->theta_dot += tau * theta_acc;
    return c->x < -2.4 || c->x > 2.4 || c->theta < -0.2095 || c->theta > 0.2095;
}

#define MAX_STEPS 500
#define MAX_AGENTS 8

/* One multi-agent episode (section 10): every step an ma_act with the observations of the agents still
 * playing and of those that just finished (their final ones, flagged terminated), the rewards of the
 * agents that acted; then ma_end with "__all__". Returns the env steps played, or -1. */
static int play_multi_agent(void *sock, const char *eid, int agents) {
    buf_t h = {0};
    int64_t id = next_id++;
    mp_map(&h, 3); mp_str(&h, "op"); mp_str(&h, "ma_start"); mp_str(&h, "id"); mp_int(&h, id);
    mp_str(&h, "episode_id"); mp_str(&h, eid);
    if (request(sock, &h, NULL, id) != 0 || !is_op(reply, reply_len, "started")) { free(h.p); return -1; }
    cart_t c[MAX_AGENTS];
    int done[MAX_AGENTS] = {0}, acted[MAX_AGENTS] = {0}, ended[MAX_AGENTS] = {0}, action[MAX_AGENTS], t = 0;
    for (int i = 0; i < agents; i++) c[i] = (cart_t){uniform(), uniform(), uniform(), uniform()};
    for (;; t++) {
        int observing = 0, paid = 0, finished = 0, playing = 0;
        for (int i = 0; i < agents; i++) {
            observing += !done[i] || ended[i]; paid += acted[i]; finished += ended[i]; playing += !done[i];
        }
        int last = !playing || t == MAX_STEPS;
        h.n = 0; id = next_id++;
        mp_map(&h, 7); mp_str(&h, "op"); mp_str(&h, last ? "ma_end" : "ma_act");
        mp_str(&h, "id"); mp_int(&h, id); mp_str(&h, "episode_id"); mp_str(&h, eid);
        mp_str(&h, "agents"); mp_array(&h, (uint32_t)observing);
        for (int i = 0; i < agents; i++) if (!done[i] || ended[i]) mp_int(&h, i);
        mp_str(&h, "obs"); mp_array(&h, (uint32_t)observing);
        for (int i = 0; i < agents; i++) if (!done[i] || ended[i]) {
            mp_array(&h, 4); mp_double(&h, c[i].x); mp_double(&h, c[i].x_dot); mp_double(&h, c[i].theta);
            mp_double(&h, c[i].theta_dot);
        }
        mp_str(&h, "rewards"); mp_array(&h, (uint32_t)paid);
        for (int i = 0; i < agents; i++) if (acted[i]) { mp_array(&h, 2); mp_int(&h, i); mp_double(&h, 1.0); }
        /* the agents that fell this step; at the end "__all__" too (truncated at MAX_STEPS) */
        mp_str(&h, last && playing ? "truncated" : "terminated");
        mp_array(&h, (uint32_t)(finished + last));
        for (int i = 0; i < agents; i++) if (ended[i]) mp_int(&h, i);
        if (last) mp_str(&h, "__all__");
        if (request(sock, &h, NULL, id) != 0 || !is_op(reply, reply_len, last ? "ended" : "ma_action")) {
            fprintf(stderr, "%s refused: %.*s\n", last ? "ma_end" : "ma_act", (int)reply_len, (const char *)reply);
            free(h.p); return -1;
        }
        if (last) break;
        rd_t ra, rb; int is_map;
        find(reply, reply_len, "agents", &ra); find(reply, reply_len, "actions", &rb);
        int n = container(&ra, &is_map); container(&rb, &is_map);
        for (int i = 0; i < agents; i++) { acted[i] = 0; ended[i] = 0; }
        for (int k = 0; k < n; k++) { int i = (int)number(&ra); action[i] = (int)number(&rb); acted[i] = 1; }
        for (int i = 0; i < agents; i++) if (acted[i] && cart_step(&c[i], action[i])) { done[i] = 1; ended[i] = 1; }
    }
    free(h.p);
    return t;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s tcp://HOST:PORT [episodes] [agents]\n", argv[0]); return 2; }
    int episodes = argc > 2 ? atoi(argv[2]) : 3, agents = argc > 3 ? atoi(argv[3]) : 1, timeout_ms = 20000, linger = 0;
    if (agents < 1 || agents > MAX_AGENTS) { fprintf(stderr, "agents: 1 to %d\n", MAX_AGENTS); return 2; }
    void *ctx = zmq_ctx_new(), *sock = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(sock, argv[1]) != 0) { fprintf(stderr, "cannot connect to %s\n", argv[1]); return 1; }

    buf_t h = {0};
    int64_t id = next_id++;
    mp_map(&h, 5); mp_str(&h, "op"); mp_str(&h, "hello"); mp_str(&h, "id"); mp_int(&h, id);
    mp_str(&h, "protocol"); mp_str(&h, "runnel-external"); mp_str(&h, "version"); mp_int(&h, agents > 1 ? 2 : 1);
    mp_str(&h, "inference_mode"); mp_str(&h, "remote");
    if (request(sock, &h, NULL, id) != 0 || !is_op(reply, reply_len, "welcome")) { fprintf(stderr, "no welcome\n"); return 1; }
    if (agents > 1) {   /* multi-agent: the server records the episodes */
        srand(7);
        for (int e = 0; e < episodes; e++) {
            char eid[32]; snprintf(eid, sizeof eid, "c-ma-%d-%d", (int)(time(NULL) % 100000), e);
            int steps = play_multi_agent(sock, eid, agents);
            if (steps < 0) return 1;
            printf("episode %s: %d steps\n", eid, steps);
        }
        zmq_close(sock); zmq_ctx_term(ctx); free(h.p);
        return 0;
    }
    rd_t fl;
    int fragment = find(reply, reply_len, "fragment_length", &fl) ? (int)number(&fl) : MAX_STEPS;
    if (fragment < 1) fragment = 1;

    static float obs[(MAX_STEPS + 1) * 4], rewards[MAX_STEPS], logps[MAX_STEPS], dists[MAX_STEPS * 2];
    static int64_t actions[MAX_STEPS];
    int received = 0, sent = 0;
    srand(7);
    for (int e = 0; e < episodes; e++) {
        char eid[32]; snprintf(eid, sizeof eid, "c-client-%d-%d", (int)(time(NULL) % 100000), e);
        h.n = 0; id = next_id++;
        mp_map(&h, 3); mp_str(&h, "op"); mp_str(&h, "start"); mp_str(&h, "id"); mp_int(&h, id);
        mp_str(&h, "episode_id"); mp_str(&h, eid);
        if (request(sock, &h, NULL, id) != 0 || !is_op(reply, reply_len, "started")) { fprintf(stderr, "start refused\n"); return 1; }
        cart_t c = {uniform(), uniform(), uniform(), uniform()};
        int t = 0, terminated = 0;
        int64_t version = 0;
        for (; t < MAX_STEPS && !terminated; t++) {
            float *o = obs + 4 * t;
            o[0] = (float)c.x; o[1] = (float)c.x_dot; o[2] = (float)c.theta; o[3] = (float)c.theta_dot;
            h.n = 0; id = next_id++;
            mp_map(&h, 4); mp_str(&h, "op"); mp_str(&h, "act"); mp_str(&h, "id"); mp_int(&h, id);
            mp_str(&h, "episode_id"); mp_str(&h, eid); mp_str(&h, "obs"); mp_array(&h, 4);
            for (int i = 0; i < 4; i++) mp_double(&h, o[i]);
            rd_t r; int is_map;
            if (request(sock, &h, NULL, id) != 0 || !is_op(reply, reply_len, "action")) { fprintf(stderr, "act failed\n"); return 1; }
            find(reply, reply_len, "action", &r); actions[t] = (int64_t)number(&r);
            find(reply, reply_len, "logp", &r); logps[t] = (float)number(&r);
            find(reply, reply_len, "weights_version", &r); version = (int64_t)number(&r);
            find(reply, reply_len, "dist", &r); container(&r, &is_map);
            dists[2 * t] = (float)number(&r); dists[2 * t + 1] = (float)number(&r);
            terminated = cart_step(&c, (int)actions[t]);
            rewards[t] = 1.0f;
        }
        float *o = obs + 4 * t;
        o[0] = (float)c.x; o[1] = (float)c.x_dot; o[2] = (float)c.theta; o[3] = (float)c.theta_dot;

        /* the episode as chunks of at most `fragment` steps, each the 15 fields of EXTERNAL.md section 3;
         * chunk k holds steps [b, e) and observations [b, e] (neighbours share the boundary row) */
        for (int b = 0, k = 0; b < t; b += fragment, k++) {
            int e = b + fragment < t ? b + fragment : t, n = e - b, last = e == t;
            buf_t meta = {0}, region = {0};
            uint64_t s_obs[2] = {(uint64_t)n + 1, 4}, s_t[1] = {(uint64_t)n}, s_dist[2] = {(uint64_t)n, 2};
            mp_array(&meta, 2); mp_str(&meta, "chunks"); mp_array(&meta, 1); mp_array(&meta, 15);
            mp_str(&meta, eid); mp_int(&meta, k);
            mp_array_ext(&meta, &region, obs + 4 * b, sizeof(float) * 4 * (n + 1), s_obs, 2, "<f4");
            mp_array_ext(&meta, &region, actions + b, sizeof(int64_t) * n, s_t, 1, "<i8");
            mp_array_ext(&meta, &region, rewards + b, sizeof(float) * n, s_t, 1, "<f4");
            mp_bool(&meta, last && terminated); mp_bool(&meta, last && !terminated);   /* a time limit otherwise */
            mp_map(&meta, 2);
            mp_str(&meta, "action_logp"); mp_array_ext(&meta, &region, logps + b, sizeof(float) * n, s_t, 1, "<f4");
            mp_str(&meta, "action_dist_inputs");
            mp_array_ext(&meta, &region, dists + 2 * b, sizeof(float) * 2 * n, s_dist, 2, "<f4");
            mp_array(&meta, 0); mp_int(&meta, b); mp_int(&meta, version); mp_int(&meta, 0); mp_int(&meta, 0);
            mp_nil(&meta); mp_nil(&meta);
            buf_t body = frame(&meta, &region);
            h.n = 0; id = next_id++;
            mp_map(&h, 3); mp_str(&h, "op"); mp_str(&h, "chunks"); mp_str(&h, "id"); mp_int(&h, id);
            mp_str(&h, "ids"); mp_array(&h, 1); mp_array(&h, 2); mp_str(&h, eid); mp_int(&h, k);
            sent++;
            if (request(sock, &h, &body, id) != 0 || !is_op(reply, reply_len, "received")) { fprintf(stderr, "chunk refused\n"); return 1; }
            received++;
            free(meta.p); free(region.p); free(body.p);
        }
        h.n = 0;
        mp_map(&h, 3); mp_str(&h, "op"); mp_str(&h, "end"); mp_str(&h, "id"); mp_int(&h, 0);
        mp_str(&h, "episode_id"); mp_str(&h, eid);
        zmq_send(sock, h.p, h.n, 0);
        printf("episode %s: %d steps\n", eid, t);
    }
    printf("%d chunks received by the server\n", received);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    free(h.p);
    return received == sent ? 0 : 1;
}
