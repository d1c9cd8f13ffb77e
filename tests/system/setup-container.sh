#!/bin/sh
# Runs inside the freshly booted test container: installs wcd the way the Debian package lays it
# out (launchers in /usr/bin, units in /usr/lib/systemd/system, the wcd user from the sysusers
# file, /run/wcd from the tmpfiles file). Read-only inputs, bind-mounted by the test:
#   /opt/wcd/lib      the working tree's wcd package
#   /opt/wcd/systemd  the working tree's systemd/ directory (units, sysusers, tmpfiles)
#   /usr/lib/wcd      wcd's Python dependencies, built for the container's python3
set -eu
umask 022

for cmd in wcd wcdctl; do
	cat >/usr/bin/$cmd <<EOF
#!/usr/bin/python3 -sP
import sys
sys.path[:0] = ["/opt/wcd/lib", "/usr/lib/wcd"]
from wcd.cli.$cmd import main
sys.exit(main())
EOF
	chmod 0755 /usr/bin/$cmd
done

install -m 0644 /opt/wcd/systemd/wcd@.service /opt/wcd/systemd/wcd@.socket /usr/lib/systemd/system/
install -m 0644 /opt/wcd/systemd/wcd.sysusers /usr/lib/sysusers.d/wcd.conf
install -m 0644 /opt/wcd/systemd/wcd.tmpfiles /usr/lib/tmpfiles.d/wcd.conf
install -d -m 0755 /etc/wcd
systemd-sysusers wcd.conf
systemd-tmpfiles --create wcd.conf
systemctl daemon-reload

# Smoke test of the install, as the daemon's user: imports the daemon without torch.
setpriv --reuid=wcd --regid=wcd --clear-groups /usr/bin/wcd serve --help >/dev/null
