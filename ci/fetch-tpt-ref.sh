#!/usr/bin/env bash
# Unpacks thin-provisioning-tools 1.x from Debian trixie into $TPT_REF (default
# /opt/dmkit-ref/thin-provisioning-tools), for the tests that compare dmkit's thin
# tools with the reference. apt downloads the .deb through a private sources list,
# state and cache; nothing of the system's apt configuration changes and nothing is
# installed. Idempotent: an unpacked reference that answers -V is kept.
set -euo pipefail
dest=${TPT_REF:-/opt/dmkit-ref/thin-provisioning-tools}
if [ -x "$dest/usr/sbin/pdata_tools" ] && "$dest/usr/sbin/thin_check" -V >/dev/null 2>&1; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb http://deb.debian.org/debian trixie main" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o "Dir::Etc::sourceparts=-"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
  -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -qq
(cd "$work" && apt-get "${apt_opts[@]}" download thin-provisioning-tools)
$sudo mkdir -p "$dest"
$sudo dpkg-deb -x "$work"/thin-provisioning-tools_*.deb "$dest"
v=$("$dest/usr/sbin/thin_check" -V)
case $v in
  1.*) echo "thin-provisioning-tools reference $v in $dest" ;;
  *) echo "ci/fetch-tpt-ref.sh: unexpected reference version '$v'" >&2; exit 1 ;;
esac
