<#
.SYNOPSIS
Install NInfer for Windows: the server runs inside a WSL distribution, Start-NInfer.cmd starts it.

.DESCRIPTION
Checks WSL and the distribution, copies this NInfer folder into it (unless it already lives
there), runs installers/install.sh inside it, then puts Start-NInfer.cmd with a ninfer-wsl.cfg
(which distribution, which folder) in %LOCALAPPDATA%\NInfer and creates Start-menu and desktop
shortcuts to it. All the logic of starting, planning and stopping stays in Python inside WSL.

.EXAMPLE
powershell -ExecutionPolicy Bypass -File installers\install-windows.ps1 -Distribution Ubuntu
#>
param(
    [string]$Distribution = "",          # default: WSL's default distribution
    [string]$LinuxDir = "",              # default: ~/ninfer inside the distribution
    [string]$Download = "",              # a Hugging Face repo id to download and serve
    [switch]$NoDesktopShortcut
)
$ErrorActionPreference = "Stop"

function Invoke-Wsl([string[]]$Arguments) {
    $all = @()
    if ($Distribution) { $all += @("-d", $Distribution) }
    & wsl.exe @all @Arguments
    if ($LASTEXITCODE -ne 0) { throw "wsl.exe $($Arguments -join ' ') failed with exit code $LASTEXITCODE" }
}

# 1. WSL and a distribution
if (-not (Get-Command wsl.exe -ErrorAction SilentlyContinue)) {
    Write-Error "WSL is not installed. In an administrator PowerShell run: wsl --install -d Ubuntu, restart, then run this again."
}
$distros = (& wsl.exe -l -q) -replace "`0", "" | Where-Object { $_.Trim() -ne "" } | ForEach-Object { $_.Trim() }
if (-not $distros) {
    Write-Error "WSL has no Linux distribution. Run: wsl --install -d Ubuntu, then run this again."
}
if ($Distribution -and -not ($distros -contains $Distribution)) {
    Write-Error "No WSL distribution named '$Distribution'. Installed: $($distros -join ', ')"
}
$shown = if ($Distribution) { $Distribution } else { "the default distribution" }
Write-Host "NInfer: installing into WSL ($shown)"

# 2. the NInfer folder inside the distribution
$source = Split-Path -Parent $PSScriptRoot
if ($source -match '^\\\\wsl(\.localhost|\$)\\([^\\]+)\\(.*)$') {
    if (-not $Distribution) { $Distribution = $Matches[2] }
    $LinuxDir = "/" + ($Matches[3] -replace '\\', '/')
} else {
    if (-not $LinuxDir) { $LinuxDir = (Invoke-Wsl @("--", "sh", "-c", 'printf %s "$HOME/ninfer"')) }
    $from = (Invoke-Wsl @("--", "wslpath", "-a", ($source -replace '\\', '/')))
    Write-Host "NInfer: copying $source to $LinuxDir"
    Invoke-Wsl @("--", "sh", "-c", "mkdir -p '$LinuxDir' && cp -r '$from'/. '$LinuxDir'/")
}

# 3. the Linux side: venv, package, desktop entry (WSLg), optional model
$install = @("--cd", $LinuxDir, "--", "bash", "installers/install.sh")
if ($Download) { $install += @("--download", $Download) }
Invoke-Wsl $install

# 4. Start-NInfer.cmd and its configuration in %LOCALAPPDATA%\NInfer, and the shortcuts
$home_ = Join-Path $env:LOCALAPPDATA "NInfer"
New-Item -ItemType Directory -Force -Path $home_ | Out-Null
$cmd = Join-Path $home_ "Start-NInfer.cmd"
Copy-Item (Join-Path $PSScriptRoot "..\launchers\Start-NInfer.cmd") $cmd -Force
$cfg = @("# written by install-windows.ps1: where Start-NInfer.cmd finds NInfer", "DIR=$LinuxDir")
if ($Distribution) { $cfg += "DISTRO=$Distribution" }
Set-Content -Path (Join-Path $home_ "ninfer-wsl.cfg") -Value $cfg -Encoding ASCII

$shell = New-Object -ComObject WScript.Shell
$places = @([Environment]::GetFolderPath("Programs"))
if (-not $NoDesktopShortcut) { $places += [Environment]::GetFolderPath("Desktop") }
foreach ($place in $places) {
    $link = $shell.CreateShortcut((Join-Path $place "NInfer.lnk"))
    $link.TargetPath = $cmd
    $link.WorkingDirectory = $home_
    $link.Description = "Start the NInfer server in WSL and open the chat"
    $link.Save()
}
Write-Host "NInfer: installed. Start it from the Start menu or the desktop (NInfer), or run $cmd"
