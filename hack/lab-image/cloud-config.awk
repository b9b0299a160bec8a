# A #cloud-config subset → shell script, for the lab OS (busybox awk).
# Supported: write_files (path, content as |, |- or a scalar, encoding b64/base64, permissions,
# owner ignored, append), bootcmd and runcmd (lists of strings), users (ignored, logged).
# Anything else is logged and ignored. Output: a POSIX sh script on stdout.
function unquote(v,   q) {
  sub(/^[ \t]+/, "", v); sub(/[ \t]+$/, "", v)
  if (v ~ /^'.*'$/) { v = substr(v, 2, length(v) - 2); gsub(/''/, "'", v); return v }
  if (v ~ /^".*"$/) {
    v = substr(v, 2, length(v) - 2)
    gsub(/\\n/, "\n", v); gsub(/\\t/, "\t", v); gsub(/\\"/, "\"", v); gsub(/\\\\/, "\\", v)
    return v
  }
  return v
}
# Output is buffered per section and printed in cloud-init's order: bootcmd, write_files, runcmd.
function emit(s) {
  if (section == "bootcmd") out_boot = out_boot s "\n"
  else if (section == "runcmd") out_run = out_run s "\n"
  else if (section == "write_files") out_files = out_files s "\n"
  else out_misc = out_misc s "\n"
}
function shq(s) { gsub(/'/, "'\\''", s); return "'" s "'" }
function indent_of(line,   m) { match(line, /^ */); return RLENGTH }
function flush_file() {
  if (fpath == "") return
  emit("mkdir -p \"$(dirname " shq(fpath) ")\"")
  redir = (fappend == "true") ? ">>" : ">"
  if (fenc ~ /^(b64|base64)$/) emit("base64 -d " redir " " shq(fpath) " <<'__METALBOOT_EOF__'")
  else emit("cat " redir " " shq(fpath) " <<'__METALBOOT_EOF__'")
  c = fcontent; sub(/\n$/, "", c)
  emit(c)
  emit("__METALBOOT_EOF__")
  if (fperm != "") emit("chmod " shq(fperm) " " shq(fpath))
  emit("echo " shq("cloud-config: wrote " fpath))
  fpath = ""; fcontent = ""; fperm = ""; fenc = ""; fappend = ""
}
function file_key(k, v) {
  if (k == "path") fpath = unquote(v)
  else if (k == "permissions") fperm = unquote(v)
  else if (k == "encoding") fenc = unquote(v)
  else if (k == "append") fappend = unquote(v)
  else if (k == "content") {
    v2 = v; sub(/^[ \t]+/, "", v2)
    if (v2 ~ /^[|>][-+]?$/) { inblock = 1; blockind = -1; fcontent = "" }
    else fcontent = unquote(v)
  }
}
BEGIN { section = ""; inblock = 0 }
NR == 1 && /^#cloud-config/ { next }
{
  line = $0
  if (inblock) {
    if (line ~ /^[ \t]*$/) { fcontent = fcontent "\n"; next }
    ind = indent_of(line)
    if (blockind < 0) blockind = ind
    if (ind >= blockind && ind > itemind) { fcontent = fcontent substr(line, blockind + 1) "\n"; next }
    inblock = 0
  }
  if (line ~ /^[ \t]*#/ || line ~ /^[ \t]*$/) next
  if (line ~ /^[A-Za-z_][A-Za-z0-9_]*:/) {
    if (section == "write_files") flush_file()
    section = line; sub(/:.*/, "", section)
    if (section != "write_files" && section != "runcmd" && section != "bootcmd")
      out_misc = out_misc "echo " shq("cloud-config: " section " is not supported by the lab OS; ignored") "\n"
    next
  }
  if (section == "write_files") {
    if (line ~ /^ *- /) {
      flush_file()
      itemind = indent_of(line)
      sub(/^ *- /, "", line)
    } else {
      sub(/^ +/, "", line)
    }
    k = line; sub(/:.*/, "", k)
    v = line; if (index(v, ":") > 0) v = substr(v, index(v, ":") + 1); else v = ""
    file_key(k, v)
    next
  }
  if (section == "runcmd" || section == "bootcmd") {
    if (line ~ /^ *- /) {
      sub(/^ *- /, "", line)
      cmd = unquote(line)
      emit("echo " shq("cloud-config " section ": " cmd))
      emit(cmd)
    }
    next
  }
}
END {
  if (section == "write_files") flush_file()
  printf "%s%s%s%s", out_misc, out_boot, out_files, out_run
}
