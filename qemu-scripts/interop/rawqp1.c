/*
 * rawqp1: what a hostile root user in a VM sends past its CM: RoCEv2 frames to QP 1 in
 * shapes a simple filter would miss, written with a packet socket on the VM's NIC.
 * qemu-scripts/apps.sh (section 7) runs it in a pvcm VM and checks that the host's
 * egress filter (qp1-divert.sh) stops every one and counts it.
 *
 * Usage: rawqp1 IFACE DST_MAC SRC_IP4 DST_IP4 OTHER_IP4 SRC_IP6 DST_IP6 CASE...
 *   v4opt  IPv4 with 4 bytes of options (IHL 6), UDP 4791, BTH destination QP 1
 *   v6ext  IPv6 with a hop-by-hop extension header before UDP 4791, QP 1
 *   vlan   an 802.1Q tag (VID 5) before IPv4, UDP 4791, QP 1
 *   frag   an IPv4 UDP fragment that is not the first (offset 64 bytes)
 *   spoof  IPv4 from OTHER_IP4 (another VM's address), UDP 4791, QP 1
 * Each case is one frame; the MAD is a CM ClassPortInfo Get. The ICRC is not computed
 * (nothing that stops the frame reads it). Exit 0 when every frame was sent.
 */
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#define ROCE_PORT 4791
#define PAYLOAD (12 + 8 + 256 + 4) /* BTH, DETH, MAD, ICRC */

static uint8_t src_mac[6], dst_mac[6];
static struct in_addr me4, peer4, other4;
static struct in6_addr me6, peer6;

static uint16_t csum(const uint8_t *p, size_t n)
{
	uint32_t s = 0;

	for (size_t i = 0; i + 1 < n; i += 2)
		s += (uint32_t)p[i] << 8 | p[i + 1];
	if (n & 1)
		s += (uint32_t)p[n - 1] << 8;
	while (s >> 16)
		s = (s & 0xffff) + (s >> 16);
	return (uint16_t)~s;
}

static size_t eth(uint8_t *f, uint16_t type, int vlan)
{
	size_t n = 0;

	memcpy(f, dst_mac, 6);
	memcpy(f + 6, src_mac, 6);
	n = 12;
	if (vlan) {
		f[n++] = 0x81;
		f[n++] = 0x00;
		f[n++] = 0x00;
		f[n++] = 0x05;
	}
	f[n++] = type >> 8;
	f[n++] = type & 0xff;
	return n;
}

/* UDP 4791 with a BTH to QP 1, a DETH and a MAD: the UDP datagram's length. */
static size_t roce_qp1(uint8_t *u)
{
	uint8_t *b = u + 8;

	memset(u, 0, 8 + PAYLOAD);
	u[0] = 0xc0;
	u[1] = 0x00;
	u[2] = ROCE_PORT >> 8;
	u[3] = ROCE_PORT & 0xff;
	u[4] = (8 + PAYLOAD) >> 8;
	u[5] = (8 + PAYLOAD) & 0xff;
	b[0] = 0x64;                   /* UD SEND only */
	b[2] = b[3] = 0xff;            /* P_Key */
	b[7] = 1;                      /* destination QP 1 */
	b[12] = 0x80;                  /* DETH Q_Key 0x80010000 */
	b[13] = 0x01;
	b[19] = 1;                     /* source QP 1 */
	b[20] = 1;                     /* MAD: base version */
	b[21] = 7;                     /* CM class */
	b[22] = 2;                     /* version */
	b[23] = 1;                     /* Get */
	b[37] = 1;                     /* ClassPortInfo */
	return 8 + PAYLOAD;
}

static size_t ipv4(uint8_t *ip, struct in_addr src, int options, uint16_t frag, size_t body)
{
	size_t h = options ? 24 : 20;
	size_t total = h + body;

	memset(ip, 0, h);
	ip[0] = 0x40 | (uint8_t)(h / 4);
	ip[2] = total >> 8;
	ip[3] = total & 0xff;
	ip[4] = 0x12;
	ip[6] = frag >> 8;
	ip[7] = frag & 0xff;
	ip[8] = 64;
	ip[9] = 17;
	memcpy(ip + 12, &src, 4);
	memcpy(ip + 16, &peer4, 4);
	if (options)
		memset(ip + 20, 1, 4); /* NOPs */
	uint16_t c = csum(ip, h);
	ip[10] = c >> 8;
	ip[11] = c & 0xff;
	return h;
}

static size_t build(const char *c, uint8_t *f)
{
	size_t n;

	if (!strcmp(c, "v4opt") || !strcmp(c, "vlan") || !strcmp(c, "spoof")) {
		n = eth(f, ETHERTYPE_IP, !strcmp(c, "vlan"));
		size_t body_at = n + (!strcmp(c, "v4opt") ? 24 : 20);
		size_t body = roce_qp1(f + body_at);
		ipv4(f + n, !strcmp(c, "spoof") ? other4 : me4, !strcmp(c, "v4opt"), 0x4000, body);
		return body_at + body;
	}
	if (!strcmp(c, "frag")) {
		n = eth(f, ETHERTYPE_IP, 0);
		memset(f + n + 20, 0xab, 64);
		ipv4(f + n, me4, 0, 8 /* offset 8 x 8 bytes */, 64);
		return n + 20 + 64;
	}
	if (!strcmp(c, "v6ext")) {
		n = eth(f, ETHERTYPE_IPV6, 0);
		uint8_t *ip = f + n;
		size_t body = roce_qp1(ip + 40 + 8);

		memset(ip, 0, 48);
		ip[0] = 0x60;
		ip[4] = (8 + body) >> 8;
		ip[5] = (8 + body) & 0xff;
		ip[6] = 0;  /* hop-by-hop options */
		ip[7] = 64;
		memcpy(ip + 8, &me6, 16);
		memcpy(ip + 24, &peer6, 16);
		ip[40] = 17; /* then UDP */
		ip[41] = 0;  /* 8 bytes */
		ip[42] = 1;  /* PadN, 4 bytes of padding */
		ip[43] = 4;
		return n + 48 + body;
	}
	return 0;
}

static int parse_mac(const char *s, uint8_t *m)
{
	return sscanf(s, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &m[0], &m[1], &m[2], &m[3], &m[4],
		      &m[5]) == 6 ? 0 : -1;
}

int main(int argc, char **argv)
{
	if (argc < 9) {
		fprintf(stderr, "usage: rawqp1 IFACE DST_MAC SRC_IP4 DST_IP4 OTHER_IP4 SRC_IP6 "
				"DST_IP6 CASE...\n");
		return 2;
	}
	if (parse_mac(argv[2], dst_mac) || inet_pton(AF_INET, argv[3], &me4) != 1 ||
	    inet_pton(AF_INET, argv[4], &peer4) != 1 || inet_pton(AF_INET, argv[5], &other4) != 1 ||
	    inet_pton(AF_INET6, argv[6], &me6) != 1 || inet_pton(AF_INET6, argv[7], &peer6) != 1) {
		fprintf(stderr, "rawqp1: bad address\n");
		return 2;
	}
	int s = socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL));
	if (s < 0) {
		perror("rawqp1: socket");
		return 1;
	}
	struct ifreq ifr;
	memset(&ifr, 0, sizeof(ifr));
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", argv[1]);
	if (ioctl(s, SIOCGIFINDEX, &ifr) < 0) {
		perror("rawqp1: interface");
		return 1;
	}
	struct ifreq hw;
	memset(&hw, 0, sizeof(hw));
	snprintf(hw.ifr_name, sizeof(hw.ifr_name), "%s", argv[1]);
	if (ioctl(s, SIOCGIFHWADDR, &hw) < 0) {
		perror("rawqp1: hardware address");
		return 1;
	}
	memcpy(src_mac, hw.ifr_hwaddr.sa_data, 6);
	struct sockaddr_ll to = {
		.sll_family = AF_PACKET,
		.sll_ifindex = ifr.ifr_ifindex,
		.sll_halen = 6,
	};
	memcpy(to.sll_addr, dst_mac, 6);
	int bad = 0;
	for (int i = 8; i < argc; i++) {
		uint8_t f[1600];
		size_t n = build(argv[i], f);
		if (!n) {
			fprintf(stderr, "rawqp1: unknown case %s\n", argv[i]);
			return 2;
		}
		if (sendto(s, f, n, 0, (struct sockaddr *)&to, sizeof(to)) != (ssize_t)n) {
			perror("rawqp1: sendto");
			bad = 1;
		} else {
			printf("sent %s (%zu bytes)\n", argv[i], n);
		}
	}
	close(s);
	return bad;
}
